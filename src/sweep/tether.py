"""Imported first by the forkserver (src/sweep/launcher.py): it dies the moment the engine does.

A forked trial dies with its parent, the forkserver (its parent-death signal). Without this the forkserver only
noticed the engine's death when its "alive" pipe closed, and then shut its interpreter down (torch, transformers,
mlflow...) before exiting: seconds, longer on a loaded machine, in which the trials went on training and some wrote
results for a sweep that was gone. Tethered, a SIGKILLed engine takes the forkserver, and with it every trial, at
once. The engine names itself in PARENT_ENV while it starts the forkserver, from its main thread (the signal follows
the thread that forked: a slot's thread ends before the engine does)."""

from src import quiet
from src.handoff import die_with_parent

die_with_parent()
# The forkserver is an interpreter of its own: it silences what the libraries it preloads would say on import (a
# trial's and the sweep's entry point do the same), else the first import of bitsandbytes says it to the terminal.
quiet.install()

"""The memory model: a setting's peak VRAM predicted term by term (model.py), fitted to a stack's measured trials
(calibration.py), asked on a CPU with `python -m src.fit` (__main__.py)."""

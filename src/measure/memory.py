"""Memory of one trial: the allocator cap that makes a large card fail where the budget's card would, and NVML's view
of the whole process on the device (CUDA context, cuBLAS workspaces, NCCL buffers), which torch's allocator misses.

Without a GPU the trial trains on the CPU, and the CPU's memory is its device memory: `HostMemory` holds the
process to the budget for real (an allocation past it fails) and measures its peak against it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from src import gpus

GIB = 1024**3
# How often a CPU trial's memory is read: often enough to see a step's transient buffers (trl's LM-head tile lives for
# milliseconds); one read of /proc costs ~20 us, ~1% of a core
HOST_INTERVAL_S = 0.002
# glibc's mallopt(M_MMAP_THRESHOLD): blocks from this size up are mapped alone and given back to the kernel when freed.
# Its default (128 KiB) rises to the size of each large block freed, up to 32 MiB, and from then on such blocks are
# kept in the heap when freed: how much the process keeps then depends on the order of its frees, not on its live
# memory. While a budget holds the process it is fixed where it starts (a trial's peak then reads the same on every
# run: 0.067 GiB +-1% for batch 8, against 0.070-0.093 unfixed, and at 4 MiB still +-12%); it costs a mapping and
# its page faults per large tensor (the tiny Llama's batch-8 step: 31 -> 71 ms of a CPU), so the budget's release
# sets it where the default ends up.
M_MMAP_THRESHOLD, MMAP_THRESHOLD, MMAP_THRESHOLD_AFTER = -3, 128 * 1024, 32 * 1024**2


def cap_to_budget(budget_gib: float) -> dict[str, float]:
    """Cap this process's caching allocator so it can hold at most what a `budget_gib` card leaves after the
    CUDA context; torch then raises a real OutOfMemoryError where the smaller card would."""
    if not torch.cuda.is_available():
        return {}
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # create the context so NVML can see what it costs
    total = torch.cuda.get_device_properties(0).total_memory
    context = _nvml_process_bytes() or 0
    usable = budget_gib * GIB - context
    if usable >= total:
        return {"cuda_context_gib": context / GIB, "device_total_gib": total / GIB}
    # Every card the trial sees is the budget's size (a model-parallel trial spans several).
    for device in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(max(usable, 0) / total, device=device)
    return {"cuda_context_gib": context / GIB, "device_total_gib": total / GIB, "allocator_cap_gib": usable / GIB}


def _nvml_process_bytes() -> int | None:
    """Device memory NVML attributes to this process on its current device, or None where NVML cannot see it."""
    return gpus.process_bytes(torch.cuda.current_device(), os.getpid())


class NvmlSampler(threading.Thread):
    """Peak device memory of this process as NVML sees it, sampled every `interval` seconds (NVML keeps no peak)."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        # CUDA's current device is per thread: the sampler's own thread would see device 0, not the rank's card.
        self.device = torch.cuda.current_device()
        self.peak = 0
        self._halt = threading.Event()

    def read(self) -> int | None:
        """Bytes NVML sees this process hold on its card now (folded into the peak), or None where it cannot."""
        used = gpus.process_bytes(self.device, os.getpid())
        if used is not None:
            self.peak = max(self.peak, used)
        return used

    def run(self) -> None:
        while not self._halt.is_set():
            self.read()
            self._halt.wait(self.interval)

    def stop(self, oom: bool = False) -> float | None:
        """The peak in GiB, after one last read. `oom`: the allocator refused an allocation. It had grown to its
        peak for that micro-step only milliseconds before, between two samples, and freed its cache before it
        raised, so the samples missed what the card held (20.11 GiB recorded where nvidia-smi's maximum read
        24.06). What the card held then is at least the allocator's own peak plus what lies outside the allocator
        (the CUDA context, libraries' own buffers), which is read now as NVML's figure less what the allocator
        holds. The request it refused is not added: the card never held it (`oom_request_gib` records it)."""
        self._halt.set()
        self.join(timeout=2)
        used = self.read()
        if oom and used is not None:
            outside = max(0, used - torch.cuda.memory_reserved(self.device))
            self.peak = max(self.peak, torch.cuda.max_memory_reserved(self.device) + outside)
        return self.peak / GIB if self.peak else None


@contextlib.contextmanager
def budget(budget_gib: float, meas: Any = None, interval_s: float = HOST_INTERVAL_S) -> Iterator[dict[str, float]]:
    """The trial's memory budget while the block runs; yields the facts to record. On a GPU, the allocator cap
    (`cap_to_budget`, for the rest of the process). Without one, `HostMemory` on the process, handed to `meas` (the
    trial's Measurements) for its peak, and lifted when the block ends, however it ends."""
    if torch.cuda.is_available():
        yield cap_to_budget(budget_gib)
        return
    host = HostMemory.hold(budget_gib, interval_s)
    if host is None:  # no /proc (not Linux): nothing holds the process to the budget, nothing is claimed
        yield {}
        return
    if meas is not None:
        meas.host = host
    try:
        yield host.facts()
    finally:
        host.release()


class HostMemory(threading.Thread):
    """The budget of a trial that trains on the CPU, on the process's own memory, enforced and measured.

    What counts is what the trial maps beyond its start-up: the private writable memory the process holds (the
    kernel's VmData: heap, anonymous mappings, thread stacks; torch's CPU tensors live there), less what the
    interpreter and the libraries held when the budget was set. Leaving the start-up out keeps the budget about
    the setting, not about which versions of torch or MLflow a machine imported. RLIMIT_DATA holds the process
    to that budget: an allocation past it is refused by the kernel (torch's CPU allocator raises "can't allocate
    memory", Python a MemoryError), as a card's allocator refuses one past the card.

    The peak is what a card's allocator reports: the most memory live at once, which one micro-step's activations
    decide (the micro-batch moves it, accumulation does not). A process, unlike a card's allocator, keeps memory a
    micro-step freed (kernels keep a cache per new sequence length) and so grows with every micro-step seen. So both
    the limit and the peak are per micro-step (`sample`, at each one's start and end): a micro-step may add to what
    the process maps at its start what the budget leaves beyond what the trial held when training began, and the
    peak is that holding plus the most one micro-step added, read from the kernel's own high-water mark of the
    process's resident memory (VmHWM, reset at each micro-step's start, after the heap's free memory went back to the
    kernel, `_trim`, so a step laid there is faulted in and counted): exact and the same on every run, not a
    sample that may miss a step's transient buffers (trl's LM-head tile lives for milliseconds). What the trial held
    when training began is what a card would hold then, its tensors (`begin_training`). Three things would make the
    figure more than a card's, and none counts: glibc keeping freed blocks to reuse, as much as the order of frees
    decides (`mmap_threshold` fixed: they go back); the pages of libtorch's code a micro-step runs for the first time
    (file-backed: the mark less the file-backed and shared pages resident at the window's end, which only grow);
    and the host's data, which a probe reads more of at a larger accumulation. With them, batch 8 read 0.106 GiB
    at accumulation 1 and 0.137 at 2, and its peak varied by 15% from run to run. Where the kernel cannot reset
    the mark, VmData is sampled every `interval_s` and at every step end instead, and the limit stays where it was
    set.
    """

    def __init__(self, budget_gib: float, baseline: int, interval_s: float) -> None:
        super().__init__(daemon=True, name="host-memory")
        import resource

        self.budget_gib = budget_gib
        self.baseline = baseline
        # Anonymous resident memory at the start (the high-water mark's baseline), or None where the mark cannot be
        # reset
        self.rss_baseline = _reset_high_water_mark()
        self._window_start: int | None = None  # anonymous memory when the open window began (None: the start-up's)
        self._held_at_training: int | None = None  # what the trial held when training began (`begin_training`)
        self._added = 0  # the most one micro-step added to what the process held at its start
        self._step = 0  # the same since the last `step_peak` (VmData held, where the mark cannot be reset)
        self._counting = True  # False once training ended (`end_training`)
        self.interval_s = interval_s
        self.peak = 0
        self._halt = threading.Event()
        self._previous = resource.getrlimit(resource.RLIMIT_DATA)
        limit = baseline + int(budget_gib * GIB)
        hard = self._previous[1]
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        self.limit = limit
        self._hard = hard

    @classmethod
    def hold(cls, budget_gib: float, interval_s: float) -> HostMemory | None:
        """Hold this process to `budget_gib` beyond what it maps now, and start sampling; None without /proc."""
        # torch's intra-op threads start at its first parallel op, each with a stack (8 MiB of VmData): start them
        # now, so the budget does not depend on how many cores the machine has
        torch.ones(1 << 20).mul_(2)
        mmap_threshold(MMAP_THRESHOLD)
        baseline = _data_bytes()
        if baseline is None:
            return None
        host = cls(budget_gib, baseline, interval_s)
        host.start()
        return host

    def sample(self) -> float:
        """GiB held beyond the start-up now; the peak follows. Called at each micro-step's start and end (by the
        trial's Measurements), it also closes a window of the peak: the first window is the start-up's (the model's
        load), each later one a micro-step's (the last of a step with the optimizer's step). Until training begins
        the peak is the start-up's (all the process took: a load past the budget is measured); from then on it is
        what the trial held when training began plus the most any one micro-step added to what it held at its own
        start: the live memory of the largest micro-step. What a micro-step keeps after it ends (a kernel's cache
        for a sequence length not seen before) is counted in that micro-step, not again in each later one, so more
        micro-steps do not read as more memory. Once training ended (`end_training`) nothing more counts."""
        held = (_data_bytes() or self.baseline) - self.baseline
        if self.rss_baseline is None:
            if self._counting:
                self.peak, self._step = max(self.peak, held), max(self._step, held)
            return held / GIB
        mark = _anon_high_water_mark() or self.rss_baseline
        if self._window_start is None:  # the start-up's window: all it held
            self.peak = max(self.peak, mark - self.rss_baseline)
        elif self._counting:
            added = mark - self._window_start
            self._added, self._step = max(self._added, added), max(self._step, added)
            self.peak = max(self.peak, self.held_at_training() + self._added)
        _trim()  # what was freed goes back: reused, it is faulted in again, and so seen in the window's mark
        start = _reset_high_water_mark()
        if start is not None:
            if self._held_at_training is None:  # training begins, and nobody said what it holds: all of it
                self._held_at_training = start - self.rss_baseline
            self._window_start = start
            self._limit_window(held)
        return held / GIB

    def begin_training(self, *holders: Any) -> None:
        """Training begins: the start-up's window closes, and what the trial holds now is what a card would hold,
        the tensors of `holders` (the model's parameters and buffers; the optimizer's state, a resumed run's).
        The rest of what the process took since the budget was set (the data, the tokenizer, the trainer's
        objects) lives beside a card, not on it, and grows with the rows a probe reads (accumulation multiplies
        them: batch 8 held 3.9 MiB more at accumulation 2 than at 1, 6% of its peak; a soak reads every row, and
        its start-up's peak was 49% above its probe's where no step's was). So the start-up's peak stops counting:
        the trial's peak is its training's, the largest of its steps' (`step_peak`)."""
        self._held_at_training = tensor_bytes(*holders)
        self.sample()
        self.peak = self._held_at_training if self.rss_baseline is not None else 0

    def end_training(self) -> None:
        """Training ended: what the trainer does after its last step (saving, tearing down) is not a step's
        memory. Not called when training fails: the failure's micro-step counts, closed at the release."""
        self.sample()
        self._counting = False

    def step_peak(self) -> float:
        """GiB: the peak of the micro-steps since the last call (an optimizer step's, called at its end), on the
        trial's peak's basis: what the trial held when training began plus the most one of them added. The step
        series a soak is drawn from: the trial's peak is the largest of these."""
        self.sample()
        step, self._step = self._step, 0
        return (step if self.rss_baseline is None else self.held_at_training() + step) / GIB

    def held_at_training(self) -> int:
        """Bytes the trial held when training began (0 before): its tensors (`begin_training`), or else all the
        process held beyond the start-up."""
        return self._held_at_training or 0

    def _limit_window(self, held: int) -> None:
        """The limit of the micro-step that begins, the process holding `held` beyond the start-up: what it maps
        now plus what the budget leaves beyond what the trial held when training began."""
        import resource

        if self._halt.is_set() or self._held_at_training is None:
            return
        limit = self.baseline + held + max(0, int(self.budget_gib * GIB) - self._held_at_training)
        if self._hard != resource.RLIM_INFINITY:
            limit = min(limit, self._hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, self._hard))

    def run(self) -> None:
        if self.rss_baseline is not None:
            return  # the kernel keeps the peak: nothing to sample
        while not self._halt.wait(self.interval_s):
            self.sample()

    def peak_gib(self) -> float:
        return self.peak / GIB

    def facts(self) -> dict[str, float]:
        """What the budget rests on: the start-up's memory (not counted) and the limit set, both in GiB."""
        return {"host_startup_gib": self.baseline / GIB, "host_limit_gib": self.limit / GIB}

    def release(self) -> None:
        """Stop sampling (the peak stays) and give the process back the limit it had."""
        import resource

        if self._halt.is_set():
            return
        self.sample()
        self._halt.set()
        self.join(timeout=2)
        resource.setrlimit(resource.RLIMIT_DATA, self._previous)
        mmap_threshold(MMAP_THRESHOLD_AFTER)


def tensor_bytes(*holders: Any) -> int:
    """Bytes of the distinct storages of the tensors `holders` hold: a module's parameters and buffers, an
    optimizer's state (accelerate's wrapper shows its optimizer's); None is skipped."""
    tensors: list[torch.Tensor] = []
    for holder in holders:
        if isinstance(holder, torch.nn.Module):
            tensors += [*holder.parameters(), *holder.buffers()]
        elif holder is not None:
            states = getattr(holder, "state", {}).values()
            tensors += [t for state in states for t in state.values() if isinstance(t, torch.Tensor)]
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _data_bytes() -> int | None:
    """The process's private writable memory (VmData, plus its small main stack), or None without /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[5]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def _status(*fields: str) -> dict[str, int] | None:
    """Sizes from one read of /proc/self/status (VmHWM, RssAnon, ...) in bytes, or None without it."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    found[name] = int(value.split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return found if len(found) == len(fields) else None


def _anon_high_water_mark() -> int | None:
    """The kernel's peak of this process's resident memory less the file-backed and shared pages resident now: its
    anonymous memory at that peak, at least (those pages only grow while nothing presses on memory). The pages of
    libtorch's code a kernel runs for the first time are not memory a card would hold."""
    status = _status("VmHWM", "RssFile", "RssShmem")
    return None if status is None else status["VmHWM"] - status["RssFile"] - status["RssShmem"]


def _reset_high_water_mark() -> int | None:
    """Reset the kernel's peak of this process's resident memory (VmHWM) to what it holds now (Linux 4.0+); the
    anonymous part of that resident memory in bytes, or None where the mark cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _anon_high_water_mark()


def _trim() -> None:
    """glibc's malloc_trim(0): the free memory of every arena back to the kernel. glibc serves a block from the free
    memory its heap already holds before it maps a new one, whatever MMAP_THRESHOLD says, and those pages may still be
    resident: a micro-step's activations laid there would never raise the window's high-water mark (seen: a 10 MiB
    tensor read as 5.7 MiB, then as nothing, in a process whose earlier work had freed that much). Trimmed at each
    window's start, every page a micro-step touches is faulted in within its window. No-op without glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def mmap_threshold(size: int) -> bool:
    """glibc: blocks of `size` bytes and more are mapped alone and go back to the kernel when freed, for the rest of
    the process (MMAP_THRESHOLD's comment says why and what it costs); False where the C library has no mallopt
    (or refuses)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, size))

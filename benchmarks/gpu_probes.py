"""What ``benchmarks/gpu_check.py`` measures inside a training run besides its step times: the time of each step's
generation and scoring (the training phase is the rest), the host syncs of the plugin's steady passes (by origin),
the flex_attention compiles of a process, and a ``torch.profiler`` summary of one steady step (the top CUDA kernels,
the share of the step the GPU sits idle)."""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from collections import Counter

#: Where a host sync comes from: the innermost frame of the stack in one of these packages (else "torch / other").
ORIGINS = (
    ("/hf_dynbsz/", "plugin"),
    ("/trl/", "TRL"),
    ("/transformers/", "transformers"),
    ("/accelerate/", "accelerate"),
)


def generation_clock(trainer) -> list[float]:
    """Seconds of each call of TRL's ``_generate_and_score_completions`` (generation, rewards, and TRL's old-policy and
    reference log-prob passes inside it), appended to the returned list as the run goes."""
    seconds: list[float] = []
    generate = trainer._generate_and_score_completions

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            synchronize = getattr(trainer, "_gpu_check_synchronize", None)
            if synchronize is not None:
                synchronize()
            seconds.append(time.perf_counter() - start)

    trainer._generate_and_score_completions = timed
    return seconds


def origin_of(stack) -> str:
    """The package of the innermost frame of ``stack`` (a ``traceback.extract_stack()``) that is not torch's own."""
    for frame in reversed(stack):
        name = frame.filename.replace("\\", "/")
        if "/torch/" in name or name.endswith(("/warnings.py", "/gpu_probes.py")):
            continue
        for part, origin in ORIGINS:
            if part in name:
                return f"{origin} ({name.split(part)[-1]}:{frame.lineno})" if origin == "plugin" else origin
        return "other"
    return "torch / other"


class SyncCounter:
    """Counts the CUDA host syncs of the training passes of steps ``first_step`` and later, by origin:
    ``torch.cuda.set_sync_debug_mode("warn")`` around the executor's passes (each sync warns), the warnings caught
    with the stack that issued them. ``passes``: the real training passes it watched."""

    def __init__(self, torch, first_step: int = 2) -> None:
        self.torch, self.first_step = torch, first_step
        self.found: Counter = Counter()
        self.passes = 0
        self.step = 0

    def install(self, executor) -> None:
        run_passes, run_pass, counter = executor._run_passes, executor._run_pass, self

        def watched_passes(model, schedule, kind, run, *args, **kwargs):
            if kind != "training":
                return run_passes(model, schedule, kind, run, *args, **kwargs)
            counter.step += 1
            if counter.step < counter.first_step:
                return run_passes(model, schedule, kind, run, *args, **kwargs)
            with counter.watching():
                return run_passes(model, schedule, kind, run, *args, **kwargs)

        def counted_pass(*args, **kwargs):
            counter.passes += counter.step >= counter.first_step
            return run_pass(*args, **kwargs)

        executor._run_passes, executor._run_pass = watched_passes, counted_pass

    @contextlib.contextmanager
    def watching(self):
        torch = self.torch
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def record(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" in str(message).lower():
                    self.found[origin_of(traceback.extract_stack())] += 1
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                warnings.showwarning = shown

    def per_pass(self) -> dict[str, float]:
        return {origin: count / max(self.passes, 1) for origin, count in self.found.most_common()}


def step_profiler(torch, step: int, cuda: bool):
    """A Trainer callback that runs ``torch.profiler`` over optimizer step ``step`` (1-based): ``.profile`` and
    ``.wall_s`` after it."""
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        def __init__(self):
            self.seen, self.profile, self.wall_s, self._active = 0, None, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            self.seen += 1
            if self.seen != step:
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self._active = torch.profiler.profile(activities=activities)
            self._active.__enter__()
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self._active is None:
                return
            if cuda:
                torch.cuda.synchronize()
            self.wall_s = time.perf_counter() - self._start
            self._active.__exit__(None, None, None)
            self.profile, self._active = self._active, None

    return StepProfiler()


def busy_seconds(events) -> float:
    """Seconds some CUDA kernel ran, from the profiler's device events (overlapping kernels counted once)."""
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in events
        if getattr(event, "device_type", None) is not None and "CUDA" in str(event.device_type)
    )
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e6


def profile_summary(profiler, cuda: bool, rows: int = 15) -> tuple[str, float | None]:
    """``(markdown, idle share)`` of a profiled step: the top operators by CUDA time (CPU time without a GPU) and the
    share of the step's wall time no CUDA kernel ran (None without a GPU)."""
    profile, wall = profiler.profile, profiler.wall_s
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    table = profile.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)
    idle = None
    if cuda:
        idle = max(0.0, 1.0 - busy_seconds(profile.events()) / wall) if wall else None
    head = f"Step wall time {wall:.3f} s" + (f"; GPU idle {idle:.0%} of it (no kernel running)." if cuda else ".")
    return f"{head}\n\n```\n{table}\n```\n", idle

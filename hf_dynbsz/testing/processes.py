"""Processes: a subprocess runner with a timeout that kills every rank it started, and the whole-process peak
resident set of a run (sampled in a thread, and read from ``/proc/self/status``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["REPO_ROOT", "ResidentSetSampler", "loaded_by_import", "run_peak_mib", "run_together", "run_with_timeout"]

#: The repository root (``hf_dynbsz/testing/processes.py`` is two folders below it).
REPO_ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from ``/proc``), whatever its session."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def loaded_by_import(module: str, libraries=("torch", "trl")) -> dict[str, bool]:
    """Whether importing ``module`` in a fresh interpreter (the repository on its path) loads each of ``libraries``."""
    import sys

    code = f"import sys, {module}; print(*(name in sys.modules for name in {tuple(libraries)!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return dict(zip(libraries, (word == "True" for word in out.stdout.split())))


def run_with_timeout(
    command: list[str], cwd, timeout: float, what: str, env: dict | None = None, expect_failure: bool = False
) -> str:
    """Run ``command`` in its own process group with the repo importable and offline; return stdout + stderr.

    Raises :class:`AssertionError` on a non-zero exit, and on timeout kills the whole group (every rank) and raises.
    ``DIFFU_*`` variables of the caller are not passed on; ``env`` adds variables. ``expect_failure``: the command
    must exit non-zero (the whole output is returned then; exiting 0 raises).
    """
    return run_together([command], cwd, timeout, what, env=env, expect_failure=expect_failure)[0]


def run_together(
    commands: list[list[str]], cwd, timeout: float, what: str, env: dict | None = None, expect_failure: bool = False
) -> list[str]:
    """Run ``commands`` side by side (each as :func:`run_with_timeout` runs one: its own process group, the repo
    importable, offline, no ``DIFFU_*``) under ONE timeout; return each one's stdout + stderr.

    For launches that only finish together, as the machines of a multi-node run: on the timeout every one of them is
    killed with every rank it started, and :class:`AssertionError` raised. Raises as well when one exits non-zero
    (``expect_failure``: when one exits 0 instead)."""
    environ = {
        **os.environ,
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    environ = {key: value for key, value in environ.items() if not key.startswith("DIFFU_")}
    environ.update(env or {})
    processes = [
        subprocess.Popen(
            command,
            cwd=cwd,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for command in commands
    ]
    outputs, readers = _read_outputs(processes)
    finished = _wait_all(processes, time.monotonic() + timeout)
    if not finished:
        _kill(processes)
    for reader in readers:
        reader.join(timeout=30)  # the pipes close when the processes (and every rank they started) are gone
    if not finished:
        shown = "\n".join(output[-4000 // len(processes) :] for output in outputs)
        raise AssertionError(f"{what} did not finish in {timeout} s (hang?):\n{shown}")
    for process, output in zip(processes, outputs):
        if expect_failure and process.returncode == 0:
            raise AssertionError(f"{what} was expected to fail and exited 0:\n{output[-6000:]}")
        if not expect_failure and process.returncode != 0:
            raise AssertionError(f"{what} failed ({process.returncode}):\n{output[-6000:]}")
    return outputs


def _read_outputs(processes: list[subprocess.Popen]):
    """``(outputs, readers)``: each process's output, filled in by a reader thread of its own (a process blocked on
    a full pipe is then not mistaken for a hang)."""
    import threading

    outputs = [""] * len(processes)

    def read(index: int) -> None:
        outputs[index] = processes[index].stdout.read()

    readers = [threading.Thread(target=read, args=(index,), daemon=True) for index in range(len(processes))]
    for reader in readers:
        reader.start()
    return outputs, readers


def _wait_all(processes: list[subprocess.Popen], deadline: float) -> bool:
    """Whether every process exited before ``deadline``."""
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def _kill(processes: list[subprocess.Popen]) -> None:
    """Kill every process and every rank it started (torch's launcher starts each rank in a session of its own)."""
    ranks = [pid for process in processes for pid in _descendants(process.pid)]  # before their parents go
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for process in processes:
        process.wait()


class ResidentSetSampler:
    """The process's peak resident set (MiB), sampled every ``interval`` seconds in a thread: independent of
    ``/proc/self/clear_refs`` resets (which the trainer makes before each pass when a memory limit is set, so that
    ``VmHWM`` at the end of a run is not the run's peak). Use as a context manager; :attr:`peak_mib` after."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval, self.peak_mib = interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from hf_dynbsz.execution.device_memory import status_mib

        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, status_mib("VmRSS") or 0.0)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        from hf_dynbsz.execution.device_memory import status_mib

        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, status_mib("VmRSS") or 0.0)


def run_peak_mib(log_history: list[dict], sampler: ResidentSetSampler | None = None) -> float:
    """A run's whole-process peak (MiB): the largest of the sampled resident set, every logged step peak
    (``dynbsz/peak_memory_mib``, carried across the trainer's per-pass resets) and ``VmHWM`` now."""
    from hf_dynbsz.execution.device_memory import status_mib

    hwm = status_mib("VmHWM") or 0.0
    logged = [entry["dynbsz/peak_memory_mib"] for entry in log_history if "dynbsz/peak_memory_mib" in entry]
    return max([hwm, *logged, sampler.peak_mib if sampler is not None else 0.0])

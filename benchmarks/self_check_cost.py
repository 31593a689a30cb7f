"""The self-check's cost: its CPU time with the gradient comparison and with log-probs alone, against a steady step.

One fresh process per mix runs ``step_time.py``'s worker (its model, mix and settings; padding-free rows with shared
prompts). At the run's first step, before the real check, the self-check runs ``--repeats`` times on that step's
samples, alternating two variants: as it runs by default (log-probs, then gradients) and with log-probs alone (the
check as it runs under ZeRO-3, where gradients are skipped). Each is timed in the process's CPU time
(``time.process_time``), less sensitive than wall time to other jobs on a shared machine; the table gives the medians
and the steady training step's CPU time of the same run (``step_time.py``'s ``train_cpu_s``, first step left out).

    python benchmarks/self_check_cost.py            # the three mixes, 7 repeats each (about 2 minutes on 2 cores)
    python benchmarks/self_check_cost.py --quick    # long-tailed only, 3 repeats

Writes ``benchmarks/results/self_check_cost.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time  # noqa: E402
from common import RESULTS_DIR, load_average, machine_description, markdown_table  # noqa: E402

from hf_dynbsz.testing import MIX_LABELS, run_script_worker  # noqa: E402

MIXES = ("long_tailed", "bimodal", "uniform")
VARIANTS = ("log-probs and gradients", "log-probs alone")


def time_the_check(repeats: int) -> dict[str, list[float]]:
    """Wraps the executor's self-check: its first call first times both variants ``repeats`` times on the step's
    samples (alternating which goes first), then runs the real check. Returns where the CPU seconds go."""
    from hf_dynbsz.execution import check_passes
    from hf_dynbsz.execution.executor import PassExecutor

    seconds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    original, skipped = PassExecutor.self_check, check_passes.CheckPasses.gradients_skipped

    def without_gradients(executor, model):
        return "timed without gradients"

    def timed(self, model, table):
        if not self.checked:
            for repeat in range(repeats):
                for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                    chosen = skipped if variant == VARIANTS[0] else without_gradients
                    check_passes.CheckPasses.gradients_skipped = staticmethod(chosen)
                    self.checked = False
                    start = time.process_time()
                    original(self, model, table)
                    seconds[variant].append(time.process_time() - start)
            check_passes.CheckPasses.gradients_skipped = staticmethod(skipped)
            self.checked = False
        return original(self, model, table)

    PassExecutor.self_check = timed
    return seconds


def worker(spec: dict) -> dict:
    """One mix in this process: ``step_time.py``'s worker with the self-check timed (:func:`time_the_check`)."""
    seconds = time_the_check(spec["repeats"])
    result = step_time.run_worker(spec)
    steady = [step["train_cpu_s"] for step in result["steps"][1:]]
    return {"mix": spec["mix"], "check_cpu_s": seconds, "steady_train_cpu_s": statistics.mean(steady)}


def row(result: dict) -> list[str]:
    gradients, alone = (statistics.median(result["check_cpu_s"][variant]) for variant in VARIANTS)
    steady = result["steady_train_cpu_s"]
    return [
        MIX_LABELS[result["mix"]],
        f"{alone:.3f}",
        f"{gradients:.3f}",
        f"{gradients / alone:.2f}x",
        f"{steady:.3f}",
        f"{alone / steady:.2f} / {gradients / steady:.2f}",
    ]


HEADER = (
    "mix",
    "check, log-probs alone: CPU s",
    "check, log-probs and gradients: CPU s",
    "gradients' share (x log-probs alone)",
    "steady training step: CPU s",
    "check in steady steps (alone / with gradients)",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="long-tailed only, 3 repeats")
    parser.add_argument("--repeats", type=int, default=7, help="timings of each variant per mix")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(worker(json.loads(args.worker))))
        return
    step_parser = step_time.build_parser()
    settings = step_time.resolve_settings(step_parser.parse_args(["--quick"] if args.quick else []), step_parser)
    base = {key: settings[key] for key in step_time.SPEC_KEYS}
    base.update(seed=0, threads=1, model="qwen2", config="padding_free", repeat=0, rounds=2)
    base["repeats"] = 3 if args.quick else args.repeats
    started, loads, results = time.perf_counter(), [load_average()], []
    for mix in MIXES[:1] if args.quick else MIXES:
        spec = dict(base, mix=mix)
        results.append(run_script_worker(Path(__file__), spec, 1800, f"self-check cost, {mix}", prefix="dynbsz-check-"))
        print(f"{mix}: {row(results[-1])}", flush=True)
        loads.append(load_average())
    write_report(args.out_dir, results, loads, time.perf_counter() - started)


def write_report(out_dir: Path, results: list[dict], loads: list[str], seconds: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(
        [
            "# The self-check's cost: gradients against log-probs alone",
            f"Generated by `python benchmarks/self_check_cost.py` in {seconds / 60:.1f} min.",
            "Model, mixes and settings: `step_time.py`'s (padding-free rows, shared prompts; 8 samples per optimizer "
            "step). The check runs on the first step's samples; medians of the repeats, in process CPU time.",
            f"Machine: {machine_description()}. Load average before and after each mix: {' | '.join(loads)}.",
            markdown_table(list(HEADER), [row(result) for result in results]),
        ]
    )
    (out_dir / "self_check_cost.md").write_text(text + "\n")
    (out_dir / "self_check_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()

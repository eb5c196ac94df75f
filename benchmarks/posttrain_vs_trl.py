"""Same wall time, same start, same data: which system's DPO and GRPO reach the better held-out tool-call
figures, lmforge's or TRL's?

Both systems start from the tiny pipeline's tool model (``lmforge pipeline run code_assistant_tiny``: the
``tools`` stage's checkpoint; TRL gets its HF export, ``lmforge.export.hf.export_hf``, llama flavor) and
train on the same rows of that pipeline: DPO on the ``preferences`` stage's training pairs, GRPO on the
``tool_data`` stage's training prompts with lmforge's ``tool_call`` reward. Each run gets the same
budget of ``--seconds`` of training; then one evaluator scores every final model: TRL's saved HF model
is converted back into an lmforge GPT (the inverse of ``lmforge.models.hf_compat.llama_state_dict_for_hf``:
q/k/v fused into ``qkv``, gate/up into ``gate_up``; checked at the start by a round trip of the starting
checkpoint), and both are scored by ``posttrain_proof.score``: the held-out tool-calling figures of the
first ``--limit`` test rows of ``tool_data`` (``lmforge.posttrain.toolcalls.evaluate_tool_calls``, greedy,
up to 64 new tokens: the figures of ``lmforge eval --tool-calls``) and the KL to the starting model on
those prompts (``posttrain_proof.kl_to``). The starting model itself is the baseline row.

Settings are posttrain_proof's ``method_values`` (the same run of each method as that proof), mapped to
TRL as ``dpo_vs_trl.py`` and ``grpo_vs_trl.py`` map them: fp32 on the CPU, AdamW at a constant learning
rate with no warm-up, no weight decay (TRL's default; lmforge's 0.1 turned off, as in those scripts,
and lmforge's beta2 set to TRL's 0.999), gradient norm clipped at 1, the same examples per optimizer
step, no activation checkpointing on either side, the run's seed as both systems' seed (data order,
sampling).

- DPO: sigmoid loss at beta ``--dpo-beta``, lr ``--dpo-lr``. lmforge packs whole pairs into 4 rows of
  2048 tokens per step (both sides of a pair in a row, each within the model's 1024 context); TRL pads
  each pair's two sequences (``max_length`` 1024 per sequence: nothing is cut) and takes lmforge's mean
  pairs per step, rounded, as its batch (``--trl-dpo-batch`` overrides). The pairs go to TRL as in
  ``dpo_vs_trl.py``: message lists, with the row's tools as a JSON string rendered by the exported chat
  template. The reference: with ``--dpo-reference live`` (the default) both systems keep the frozen
  starting model and run it on every batch, TRL's default, so a step does the same kinds of work on
  both sides; with ``precompute`` both score every training pair once up front (lmforge's default,
  TRL's ``precompute_ref_log_probs``) and that pass counts inside each run's budget: its clock starts
  when the pass starts. (lmforge's own ``training.max_time_minutes`` would not count it: that clock
  starts in ``Trainer.fit``, after ``TrainData.bind_model`` has run the pass. Here neither system's
  time limit is used: this script stops both.) At the default budget the pass is the wrong choice for
  either system: it scores all 1,000 pairs (``dpo_vs_trl.py`` measured 71 s for 1,000 shorter pairs
  on two threads) where a 180 s run trains on a few hundred.
- GRPO: ``tool_call`` reward, 4 prompts x 8 completions per optimizer step, all 32 in one forward and
  backward (lmforge ``micro_batch_size`` 32, TRL ``per_device_train_batch_size`` 32, one generation per
  step), sampled at temperature 0.7 (top-p 1, no top-k) up to 64 new tokens, KL to the frozen start at
  beta 0.04 (a reference run on every rollout on both sides), clip 0.2, one update per rollout,
  advantages scaled by the group's std, the loss averaged over the step's tokens (lmforge ``token``,
  TRL ``dapo``), lr ``--grpo-lr``. The prompts go to TRL as ``grpo_vs_trl.trl_rows`` renders them (the
  same token ids lmforge prompts with), the reward wrapped in TRL's signature. lmforge generates with
  its KV-cached engine, TRL with transformers' ``generate`` (no vLLM on a CPU).

The budget: from the start of the first training step (or of the reference pass, when one is run)
to the end of an optimizer step: the step boundary nearest the budget, before or after it (a run stops
once a next step as long as the last one would overshoot the budget by more than the run now falls
short of it). The nearest boundary rather than the first one past the budget, because a TRL GRPO step
is several times longer than an lmforge one: stopping past the budget would give TRL's runs the more
extra time. The "s" column shows the seconds actually spent, "steps" the optimizer steps done and
"examples" the pairs (DPO) or completions (GRPO) trained on. lmforge's Trainer is driven step by step
(``Trainer.step_once``, as the throughput scripts do); TRL's ``Trainer.train`` runs with a callback
that sets ``control.should_training_stop`` at the end of the step where the run stops. Loading models,
rendering and tokenizing the data, saving and scoring are outside the budget on both sides. Each seed
runs lmforge and then TRL back to back, so that a change in the machine's load touches both (the JSON
keeps the load average at the end of each run). Nothing here asserts on speed or quality: the script
prints what it measured.

    lmforge pipeline run code_assistant_tiny --out-dir /tmp/pipe_tiny
    pip install 'lmforge[bench]'      # TRL
    OMP_NUM_THREADS=1 python benchmarks/posttrain_vs_trl.py --pipeline /tmp/pipe_tiny --seeds 0 1 2 \\
        --json benchmarks/results/posttrain_vs_trl.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from common import cpu_name, cpu_run, trl_preference_rows

SYSTEMS = ("lmforge", "TRL")
DPO_SEQ_LEN, DPO_ROWS = 2048, 4  # posttrain_proof's dpo run: 4 packed rows of 2048 tokens per step
GRPO = {"group": 8, "prompts": 4, "max_new_tokens": 64, "temperature": 0.7, "beta": 0.04, "seq_len": 1024}


# ---- the starting model, both ways --------------------------------------------------------------
def llama_state_dict_from_hf(hf_state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` weights under lmforge GPT (llama flavor) names: q/k/v stacked into ``qkv``
    and gate/up into ``gate_up``, in the order ``llama_state_dict_for_hf`` splits them."""
    out = {"tok_embed.weight": hf_state["model.embed_tokens.weight"],
           "norm_f.weight": hf_state["model.norm.weight"],
           # a tied head is not in a saved HF state dict: lmforge ties it to the embedding on load
           "lm_head.weight": hf_state.get("lm_head.weight", hf_state["model.embed_tokens.weight"])}
    for i in range(n_layer):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        out[ours + "norm_1.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[ours + "attn.qkv.weight"] = torch.cat([hf_state[attn + f"{p}_proj.weight"] for p in "qkv"])
        out[ours + "attn.proj.weight"] = hf_state[attn + "o_proj.weight"]
        out[ours + "norm_2.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        out[ours + "mlp.gate_up.weight"] = torch.cat([hf_state[mlp + "gate_proj.weight"],
                                                      hf_state[mlp + "up_proj.weight"]])
        out[ours + "mlp.proj.weight"] = hf_state[mlp + "down_proj.weight"]
    return out


def lmforge_from_hf(hf_dir: Path, sft_dir: Path):
    """The HF model saved in ``hf_dir`` as an lmforge GPT with the starting model's config."""
    from transformers import AutoModelForCausalLM

    from lmforge.models import build_model, load_model

    config = load_model(sft_dir).config
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    state = llama_state_dict_from_hf({k: v.detach() for k, v in hf_model.state_dict().items()}, config.n_layer)
    model = build_model(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not model.is_tied_key(k)]
    if missing or unexpected:
        raise RuntimeError(f"{hf_dir} does not convert: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def round_trip(sft_dir: Path, hf_dir: Path, prompt: list[int]) -> dict:
    """Export -> HF -> back: the weights must come back bit for bit, and the HF model's logits must be
    lmforge's (up to float rounding)."""
    from transformers import AutoModelForCausalLM

    from lmforge.models import load_model

    sft = load_model(sft_dir).eval()
    back = lmforge_from_hf(hf_dir, sft_dir)
    ours, theirs = sft.state_dict(), back.state_dict()
    same = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.tensor([prompt])
    hf_logits = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits
    diff_hf = float((hf_logits - sft.logits(ids)).abs().max())
    diff_back = float((back.logits(ids) - sft.logits(ids)).abs().max())
    if not same or diff_back != 0.0 or diff_hf > 1e-3:
        raise RuntimeError(f"the HF round trip is not exact: weights identical {same}, max |logit diff| HF "
                           f"{diff_hf:.2e}, back-converted {diff_back:.2e}")
    return {"weights_identical": same, "max_logit_diff_hf": diff_hf, "max_logit_diff_back": diff_back,
            "tokens": len(prompt)}


# ---- the runs ---------------------------------------------------------------------------------
def lmforge_values(method: str, seed: int, sft: Path, data: Path, work: Path, args) -> dict:
    """posttrain_proof's ``method_values`` with the optimizer settings of the throughput scripts."""
    common = {"name": f"{method}_s{seed}", "out_dir": str(work / "runs"), "seed": seed,
              "logging": {"tensorboard": False, "progress_bar": False}}
    training = {"init_from": str(sft), "device": "cpu", "precision": "fp32", "peak_flops": 1e12,
                "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0, "beta2": 0.999, "grad_clip": 1.0,
                "save_interval": 0, "eval_interval": 0, "max_steps": 1_000_000}  # this script stops the run
    if method == "dpo":
        return {**common, "kind": "dpo", "recipe": {"beta": args.dpo_beta, "reference": args.dpo_reference},
                "data": {"train_path": str(data), "seq_len": DPO_SEQ_LEN},
                "training": {**training, "micro_batch_size": DPO_ROWS, "lr": args.dpo_lr}}
    per_step = GRPO["prompts"] * GRPO["group"]
    return {**common, "kind": "grpo",
            "recipe": {"rewards": ["tool_call"], "group_size": GRPO["group"], "prompts_per_rollout": GRPO["prompts"],
                       "max_new_tokens": GRPO["max_new_tokens"], "temperature": GRPO["temperature"], "top_p": 1.0,
                       "top_k": 0, "beta": GRPO["beta"], "epsilon": 0.2, "iterations": 1, "scale_rewards": True,
                       "loss_aggregation": "token", "generation_batch_size": per_step},
            "data": {"train_path": str(data), "seq_len": GRPO["seq_len"]},
            "training": {**training, "micro_batch_size": per_step, "grad_accum_steps": 1, "lr": args.grpo_lr}}


def run_lmforge(method: str, seed: int, sft: Path, data: Path, work: Path, out: Path, args) -> dict:
    import lmforge.recipes.dpo.reference as dpo_reference
    from lmforge.config import load_config
    from lmforge.train.loop import Trainer

    cfg = load_config(values=lmforge_values(method, seed, sft, data, work, args))
    model, data_, devinfo, dist = cpu_run(cfg, sft)

    # With reference: precompute the pass runs while the Trainer is built (TrainData.bind_model): the
    # budget's clock starts when it starts.
    clock: dict[str, float] = {}
    score_all = dpo_reference.precompute_reference_logps

    def timed_pass(*a, **kw):
        clock.setdefault("t0", time.perf_counter())
        table = score_all(*a, **kw)
        clock["ref_pass_s"] = time.perf_counter() - clock["t0"]
        return table

    dpo_reference.precompute_reference_logps = timed_pass
    try:
        trainer = Trainer(cfg, model, data_, devinfo, dist, work / "runs" / cfg.name)
    finally:
        dpo_reference.precompute_reference_logps = score_all
    loader = data_.train
    seen = {"examples": 0, "reward": 0.0, "rollouts": 0}
    draw = loader.next_batch

    def counted():
        batch = draw()
        seen["examples"] += int(batch["num_examples"])  # pairs (dpo) or completions (grpo)
        if method == "grpo" and loader.handed == 1:  # the first micro-batch of a new rollout
            seen["reward"] += batch["rollout_stats"]["reward"]
            seen["rollouts"] += 1
        return batch

    loader.next_batch = counted
    clock["last"] = time.perf_counter()
    t0 = clock.setdefault("t0", clock["last"])
    steps = 0
    while True:
        trainer.step_once()
        steps += 1
        if spent(clock, time.perf_counter(), args.seconds):
            break
    seconds = time.perf_counter() - t0
    model.save_pretrained(out)
    result = {"steps": steps, "seconds": seconds, "examples": seen["examples"],
              "ref_pass_s": clock.get("ref_pass_s", 0.0)}
    if method == "grpo":
        result["train_reward"] = seen["reward"] / max(seen["rollouts"], 1)
    return result


def spent(clock: dict, now: float, seconds: float) -> bool:
    """At the end of an optimizer step (at ``now``): stop here if the budget is spent, or if a next step
    as long as this one would end further past the budget than this one ends short of it. The run so
    stops at the step boundary nearest the budget, on either side, whatever the length of a step."""
    step = now - clock["last"]
    clock["last"] = now
    return now - clock["t0"] + step / 2 >= seconds


def budget_callback(args, clock: dict):
    """A TrainerCallback that starts the clock when training starts (unless the reference pass already
    did) and stops training at the step boundary nearest ``--seconds`` (``spent``)."""
    from transformers import TrainerCallback

    class Budget(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            clock["last"] = time.perf_counter()
            clock.setdefault("t0", clock["last"])

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            if spent(clock, now, args.seconds):
                clock["t1"] = now
                clock["steps"] = state.global_step
                control.should_training_stop = True

    return Budget()


def trl_common(seed: int, work: Path, name: str) -> dict:
    """TRLConfig settings both methods share: the throughput scripts' mapping."""
    return {"output_dir": str(work / name), "max_steps": 1_000_000, "lr_scheduler_type": "constant",
            "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0, "logging_steps": 1_000_000,
            "save_strategy": "no", "report_to": [], "use_cpu": True, "bf16": False, "dataloader_num_workers": 0,
            "seed": seed, "disable_tqdm": True,
            "gradient_checkpointing": False}  # TRL's default is on (saves memory, costs time)


def run_trl_dpo(seed: int, hf: Path, data: Path, work: Path, out: Path, args) -> dict:
    from trl import DPOConfig, DPOTrainer

    ds, tokenizer, model = trl_preference_rows(data, hf)  # as dpo_vs_trl.py gives them
    clock: dict[str, float] = {}
    seen = {"examples": 0}

    class BudgetedDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            clock.setdefault("t0", time.perf_counter())
            table = super()._precompute_ref_logps(dataset, name, batch_size)
            clock["ref_pass_s"] = time.perf_counter() - clock["t0"]
            return table

    config = DPOConfig(**trl_common(seed, work, f"trl_dpo_s{seed}"), max_length=1024, beta=args.dpo_beta,
                       loss_type=["sigmoid"], per_device_train_batch_size=args.trl_dpo_batch,
                       learning_rate=args.dpo_lr, precompute_ref_log_probs=args.dpo_reference == "precompute")
    trainer = BudgetedDPOTrainer(model=model, args=config, train_dataset=ds, processing_class=tokenizer,
                                 callbacks=[budget_callback(args, clock)])
    step = trainer.training_step

    def counting_step(model_, inputs, *a, **kw):
        seen["examples"] += inputs["attention_mask"].shape[0] // 2  # chosen rows, then rejected rows
        return step(model_, inputs, *a, **kw)

    trainer.training_step = counting_step
    trainer.train()
    trainer.save_model(str(out))
    return {"steps": clock["steps"], "seconds": clock["t1"] - clock["t0"], "examples": seen["examples"],
            "ref_pass_s": clock.get("ref_pass_s", 0.0)}


def run_trl_grpo(seed: int, hf: Path, data: Path, work: Path, out: Path, args) -> dict:
    import datasets
    from grpo_vs_trl import trl_rows
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from lmforge.posttrain.rewards import tool_call as lmforge_tool_call

    rows = trl_rows(data, hf, SimpleNamespace(seq_len=GRPO["seq_len"], max_new_tokens=GRPO["max_new_tokens"]))
    ds = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
    clock: dict[str, float] = {}
    seen = {"examples": 0, "reward": 0.0, "rollouts": 0}

    def tool_call(prompts, completions, row, **kwargs):
        """lmforge's tool_call reward in TRL's signature: ``row`` is the dataset column, one per completion."""
        scores = lmforge_tool_call([json.loads(r) for r in row], completions)
        seen["examples"] += len(completions)
        seen["reward"] += sum(scores) / len(scores)
        seen["rollouts"] += 1
        return scores

    per_step = GRPO["prompts"] * GRPO["group"]
    config = GRPOConfig(**trl_common(seed, work, f"trl_grpo_s{seed}"), per_device_train_batch_size=per_step,
                        gradient_accumulation_steps=1, num_generations=GRPO["group"],
                        max_completion_length=GRPO["max_new_tokens"], temperature=GRPO["temperature"], top_p=1.0,
                        top_k=0, beta=GRPO["beta"], epsilon=0.2, num_iterations=1, scale_rewards="group",
                        loss_type="dapo", learning_rate=args.grpo_lr, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=tool_call, args=config, train_dataset=ds,
                          processing_class=tokenizer, callbacks=[budget_callback(args, clock)])
    trainer.train()
    trainer.save_model(str(out))
    return {"steps": clock["steps"], "seconds": clock["t1"] - clock["t0"], "examples": seen["examples"],
            "ref_pass_s": 0.0, "train_reward": seen["reward"] / max(seen["rollouts"], 1)}


# ---- the command ------------------------------------------------------------------------------
def check_pipeline(p: argparse.ArgumentParser, pipe: Path) -> Path:
    """The tool model's checkpoint directory, or a clear error naming what is missing."""
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.errors import LMForgeError

    build = f"build it with: lmforge pipeline run code_assistant_tiny --out-dir {pipe}"
    if not pipe.is_dir():
        p.error(f"--pipeline {pipe} is not a directory; {build}")
    needed = [pipe / "tool_data" / "train.jsonl", pipe / "tool_data" / "test.jsonl",
              pipe / "preferences" / "train.jsonl"]
    missing = [str(f) for f in needed if not f.is_file()]
    if missing:
        p.error(f"--pipeline {pipe} is not a finished tiny pipeline (missing {', '.join(missing)}); {build}")
    try:
        sft_dir = resolve_model_dir(pipe / "tools")
    except LMForgeError as e:
        p.error(f"--pipeline {pipe} has no tool model ({e}); {build}")
    return sft_dir


def figures_line(figures: dict) -> str:
    return ", ".join(f"{k} " + ("-" if v is None else f"{v:.3f}") for k, v in figures.items())


def cell(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    sd = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline", required=True, help="the tiny pipeline's output directory")
    p.add_argument("--methods", nargs="+", choices=["dpo", "grpo"], default=["dpo", "grpo"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--seconds", type=float, default=180.0, help="training wall time of every run")
    p.add_argument("--limit", type=int, default=100, help="held-out test rows scored")
    p.add_argument("--dpo-lr", type=float, default=2e-5)
    p.add_argument("--dpo-beta", type=float, default=0.1)
    p.add_argument("--dpo-reference", choices=["live", "precompute"], default="live",
                   help="both systems: run the frozen reference on every batch, or score every pair once up "
                        "front (inside the budget)")
    p.add_argument("--trl-dpo-batch", type=int, default=0,
                   help="TRL's pairs per step (default: lmforge's mean pairs per step, rounded)")
    p.add_argument("--grpo-lr", type=float, default=2e-5)
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    if args.seconds <= 0 or args.limit < 1:
        p.error("--seconds must be > 0 and --limit at least 1")
    pipe = Path(args.pipeline)
    sft_dir = check_pipeline(p, pipe)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    import datasets
    import transformers

    datasets.disable_progress_bars()  # TRL's tokenizing and the weight loading: bars, not figures
    transformers.utils.logging.disable_progress_bar()

    from posttrain_proof import FIGURES, score

    from lmforge.config import load_config
    from lmforge.export.hf import export_hf
    from lmforge.infer.loading import find_tokenizer
    from lmforge.models import load_model
    from lmforge.posttrain.rollout import encode_prompt
    from lmforge.posttrain.toolcalls import load_rows
    from lmforge.tokenizer import Tokenizer
    from lmforge.train.distributed import DistInfo

    tokenizer = Tokenizer.load(find_tokenizer(sft_dir))
    sft = load_model(sft_dir).eval()
    rows = load_rows(pipe / "tool_data", "test")[:args.limit]
    prompts = [encode_prompt(tokenizer, r) for r in rows]
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf = export_hf(sft_dir, work / "hf")
        checked = round_trip(sft_dir, hf, prompts[0])
        print(f"round trip lmforge -> HF -> lmforge: weights identical, max |logit diff| of the HF model "
              f"{checked['max_logit_diff_hf']:.1e} ({checked['tokens']} tokens)", flush=True)
        # The training split only, on both sides: neither evaluates during training.
        data = {"dpo": work / "pairs", "grpo": work / "prompts"}
        for method, stage in (("dpo", "preferences"), ("grpo", "tool_data")):
            data[method].mkdir()
            (data[method] / "train.jsonl").symlink_to((pipe / stage / "train.jsonl").resolve())
        if "dpo" in args.methods and not args.trl_dpo_batch:
            cfg = load_config(values=lmforge_values("dpo", 0, sft_dir, data["dpo"], work, args))
            loader = cfg.spec.build_data(cfg, DistInfo()).train
            args.trl_dpo_batch = max(1, round(len(loader.store) * DPO_ROWS / loader.rows_per_epoch))
        baseline = score(sft_dir, sft, tokenizer, rows, prompts, 0)
        print("sft: " + figures_line(baseline), flush=True)
        for method in args.methods:
            for seed in args.seeds:
                for system in SYSTEMS:
                    out = work / f"{method}_{system}_s{seed}"
                    if system == "lmforge":
                        run = run_lmforge(method, seed, sft_dir, data[method], work, out, args)
                        model_dir = out
                    else:
                        trl_run = run_trl_dpo if method == "dpo" else run_trl_grpo
                        run = trl_run(seed, hf, data[method], work, out, args)
                        model_dir = work / f"{method}_{system}_s{seed}_lmforge"
                        lmforge_from_hf(out, sft_dir).save_pretrained(model_dir)
                    run["load_avg"] = os.getloadavg()[0]  # the machine's load over the run's last minute
                    gc.collect()
                    figures = score(model_dir, sft, tokenizer, rows, prompts, seed)
                    results.setdefault(method, {}).setdefault(system, []).append({**figures, **run})
                    ref = f" (reference pass {run['ref_pass_s']:.0f} s)" if run["ref_pass_s"] else ""
                    print(f"{method} {system} seed {seed}: {run['steps']} steps, {run['examples']} examples in "
                          f"{run['seconds']:.0f} s{ref}; " + figures_line(figures), flush=True)

    columns = (*FIGURES, "kl")
    print(f"\nheld-out tool calls after {args.seconds:g} s of training ({len(rows)} test rows, greedy; KL to the "
          f"SFT model), mean ± std over seeds {args.seeds}; DPO reference {args.dpo_reference}, lmforge "
          f"{DPO_ROWS} rows of {DPO_SEQ_LEN}/step, TRL {args.trl_dpo_batch} pairs/step; GRPO {GRPO['prompts']} x "
          f"{GRPO['group']} completions/step; fp32, {torch.get_num_threads()} threads, {cpu_name()}")
    print(f"{'run':<14} " + " ".join(f"{k:>22}" for k in columns)
          + f" {'steps':>13} {'s':>7} {'examples':>8} {'train reward':>15}")
    print(f"{'sft':<14} " + " ".join(f"{cell([] if baseline[k] is None else [baseline[k]]):>22}" for k in columns))
    for method, systems in results.items():
        for system, runs in systems.items():
            cells = [cell([r[k] for r in runs if r[k] is not None]) for k in columns]
            reward = cell([r["train_reward"] for r in runs]) if "train_reward" in runs[0] else "-"
            print(f"{method + ' ' + system:<14} " + " ".join(f"{c:>22}" for c in cells)
                  + f" {cell([r['steps'] for r in runs], 0):>13} {statistics.fmean(r['seconds'] for r in runs):>7.0f}"
                  f" {statistics.fmean(r['examples'] for r in runs):>8.0f} {reward:>15}")
    for method, systems in results.items():
        if len(systems) == 2:
            ours, theirs = systems["lmforge"], systems["TRL"]
            mean = statistics.fmean
            deltas = ", ".join(f"{k} {mean(r[k] for r in ours) - mean(r[k] for r in theirs):+.3f}"
                               for k in columns if all(r[k] is not None for r in ours + theirs))
            steps = statistics.fmean(r["steps"] for r in ours) / statistics.fmean(r["steps"] for r in theirs)
            print(f"{method}: lmforge - TRL, means: {deltas}; optimizer steps in the budget {steps:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": vars(args), "cpu": cpu_name(), "threads": torch.get_num_threads(), "sft_checkpoint": str(sft_dir),
            "round_trip": checked, "dpo_lmforge_rows_per_step": DPO_ROWS, "dpo_seq_len": DPO_SEQ_LEN, "grpo": GRPO,
            "baseline": baseline, "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""PPO throughput: lmforge's ppo kind against TRL's PPOTrainer, same policy, reward model and prompts, one run.

Which TRL: TRL removed its PPOTrainer after 1.12 (huggingface/trl PR #7020); 1.12.0 still has it as
``trl.experimental.ppo.PPOTrainer``. Install that version in an environment of its own (it would
downgrade the TRL the other benchmarks use) and run this script with that environment's Python:

    python -m venv --system-site-packages /tmp/trlppo && /tmp/trlppo/bin/pip install 'trl==1.12.0'
    OMP_NUM_THREADS=1 /tmp/trlppo/bin/python benchmarks/ppo_vs_trl.py --steps 6 --warmup 1

The models. Both improve the same seeded llama-flavor checkpoint (lmforge's own, and its HF export
for TRL). The reward model is a freshly initialised one of lmforge's reward kind
(``lmforge.models.reward.RewardModel``: the policy's trunk and a seeded ``head``, Linear(n_embd, 1)
with a zero bias), saved as a reward checkpoint (``recipe.reward_model``). TRL gets the same model as a
``LlamaForSequenceClassification`` (num_labels=1) loaded from the HF export (the same trunk weights)
with ``score.weight`` = the head's weight (no bias: the head's is zero). Before anything is timed the
script checks that both give the same score at every position of two left-padded sequences, through
TRL's own ``get_reward`` (it stops if they differ by more than 1e-4). Value model: lmforge starts it
from the reward model; TRL takes a second copy of the same sequence-classification model. Reference:
both keep a frozen copy of the starting policy (lmforge loads ``training.init_from``; TRL copies the
policy, its default).

The prompts. Tool-calling rows (``lmforge data tool-calls``): each row's messages but the last,
assistant, turn (``lmforge.posttrain.rollout.prompt_messages``), rendered with the chat template and
the row's tools, eos first: TRL's dataset holds exactly the ids lmforge prompts with
(``encode_prompt`` with the checkpoint's tokenizer), left-padded by TRL's collator. Prompts longer than
``--seq-len`` minus ``--max-new-tokens`` are left out on both sides. Each system draws its prompts in
its own shuffled order (the "prompt tokens/reply" column shows what each drew).

The settings, one to one (lmforge ``recipe.*`` / ``training.*`` = TRL ``PPOConfig``):

- replies per rollout, one per prompt: ``prompts_per_rollout`` = ``--replies`` = TRL's local batch,
  ``per_device_train_batch_size`` x ``gradient_accumulation_steps`` (``num_mini_batches=1``);
- forward/backward size: ``micro_batch_size`` = ``per_device_train_batch_size`` = ``--micro``;
- optimizer steps: TRL 1.12 steps its optimizer inside ``accelerator.accumulate``, i.e. once per
  ``gradient_accumulation_steps`` micro-batches, and an epoch over a rollout is exactly that many: one
  step per epoch, ``num_ppo_epochs`` per rollout (more ``num_mini_batches`` would only regroup the
  micro-batches, not add steps). lmforge is set to the same: ``grad_accum_steps`` = replies / micro,
  so an optimizer step is one epoch over the rollout and a rollout is ``ppo_epochs`` steps. Both
  sides' optimizer steps (a step hook on each optimizer) and micro-batches (lmforge's loader, TRL's
  update forwards) are counted over the timed rollouts and printed ("opt steps x micro"). Accelerate
  would also step at the end of each pass over TRL's dataloader, once every prompts / replies
  rollouts: far more rollouts than a run here takes;
- ``ppo_epochs`` = ``num_ppo_epochs`` = ``--ppo-epochs`` (4, seed 004's); ``max_new_tokens`` =
  ``response_length``; ``temperature`` (top-p 1, no top-k on both); ``kl_coef`` (k1 estimator on both);
  gamma 1, lam 0.95, ``clip`` = ``cliprange`` 0.2, ``clip_value`` = ``cliprange_value`` 0.2,
  ``vf_coef`` 0.1, ``missing_eos_penalty`` 1.0 (TRL with ``stop_token="eos"``); no reward whitening;
- AdamW at the same constant ``--lr``, no weight decay, betas (0.9, 0.999), fp32, no activation
  checkpointing (``activation_checkpointing=False``, which also overrides PPOConfig's default of
  ``gradient_checkpointing=True``, its deprecated alias; checked off before the run), no reporting.
  Gradient clipping: lmforge clips at 1; TRL 1.12's PPO loop never clips (it ignores
  ``max_grad_norm``, set to 1 anyway). lmforge computes the gradient norm either way: no extra work;
- generation: lmforge samples with its KV-cached, continuously batched engine (the server's), the whole
  rollout at once (``generation_batch_size``); TRL with transformers' ``generate``, the whole rollout
  at once (``local_rollout_forward_batch_size``): each system's default on a CPU.

What a rollout is, on each side: sampling the replies, the reward model's score, the no-grad passes
and ``ppo_epochs`` epochs of updates (policy and value model forward and backward). Both take the old
log-probs from the sampler (lmforge's engine keeps each drawn token's log-probability; TRL reads the
scores ``generate`` returns) and run two no-grad passes, the reference's log-probs and the value
model's values. lmforge packs each micro-batch's prompt + reply sequences into one row on a CPU (its
attention runs per sequence there, so a long row costs nothing a short one would not, and has no
padding between sequences), computes logits and values at the scored positions only, and runs its
last transformer block at those positions only (the prompts' keys and values are all it needs of
them); TRL pads every sequence of a rollout to its longest prompt plus its longest reply ("padded
width") and computes logits and values at every position. The same arithmetic either way: what
lmforge leaves out are outputs nothing reads. The reward is read where each side reads it: lmforge scores the decoded reply re-encoded with
a closing eos (at that eos), TRL at the reply's last token (its eos, or its last generated token).

Reported per system, over the timed window (``--warmup`` whole rollouts first, then ``--steps`` whole
rollouts: for lmforge ``ppo_epochs`` ``Trainer.step_once`` calls each; for TRL from the
``on_step_end`` callback after the warm-up rollouts to the one after the last: TRL calls it once per
rollout, after the rollout's updates): replies per second (the headline), generated tokens per second
(each reply's tokens, its closing eos included) and tokens per reply. The freshly seeded model writes
noise, so nearly every reply runs to ``--max-new-tokens`` on both sides (the "tokens/reply" and "eos"
columns show it): a test of the machinery's speed, not of learning. A profile per rollout splits each
side's time into sampling, the reward model's scoring, the no-grad passes (policy/reference/value,
with GAE for lmforge) and the updates with everything else (timers around lmforge's sampler, reward
functions and rollout; around TRL's ``generate``, ``get_reward`` and no-grad ``forward``).

The systems run one after the other in one process, on this machine's threads (``OMP_NUM_THREADS``):
a machine shared with other jobs slows whichever runs beside them, so the 1-minute load average at the
end of each timed window is printed too, and the ratio is also given per CPU second of this process
(``time.process_time``: at one thread it leaves out the time other jobs held the core, though not
their pressure on caches and memory). The positions each update micro-batch runs over (and how many
are real tokens rather than padding) are printed for both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from common import add_model_args, cpu_name, cpu_run

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental warns on import otherwise

PHASES = ("generation", "scoring", "passes", "update")


def prepare(work: Path, args) -> tuple[Path, Path, Path, Path]:
    """Tool-calling prompts, a tokenizer trained on them, a seeded llama checkpoint and its HF export, and a
    freshly initialised reward model on the checkpoint's trunk, saved as a reward-kind checkpoint."""
    from grpo_vs_trl import prepare as prepare_prompts

    from lmforge.models import load_model
    from lmforge.models.reward import RewardModel, reward_config_from
    from lmforge.tokenizer import Tokenizer

    data, ckpt, hf = prepare_prompts(work, args)  # the prompts and policy grpo_vs_trl.py uses
    policy = load_model(ckpt)
    torch.manual_seed(1)  # the head's draw
    reward = RewardModel(reward_config_from(policy.config))
    reward.load_initial_weights(policy, str(ckpt))  # the trunk: the policy's weights; the head stays seeded
    reward_dir = reward.save_pretrained(work / "reward")
    Tokenizer.load(ckpt / "tokenizer.json").save(reward_dir)  # a reward checkpoint carries its tokenizer
    return data, ckpt, hf, reward_dir


def trl_scorer(hf: Path, reward_dir: Path):
    """The reward model as TRL takes it: a LlamaForSequenceClassification on the export's trunk whose
    ``score`` is the lmforge head's weight (its bias is zero, and ``score`` has none)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf, num_labels=1, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    head = load_file(str(reward_dir / "model.safetensors"))
    if float(head["head.bias"].abs().max()) != 0.0:
        raise SystemExit("the reward head has a non-zero bias; LlamaForSequenceClassification's score has none")
    with torch.no_grad():
        model.score.weight.copy_(head["head.weight"])
    return model.eval()


def check_same_scores(reward_dir: Path, scorer, prompts: list[list[int]], pad_id: int) -> float:
    """Both reward models' scores at every real position of two sequences (prompt + a few tokens of it
    again, left-padded into one batch as TRL lays out a rollout), read through TRL's ``get_reward``.
    Returns the largest difference; stops the script when it is over 1e-4."""
    from trl.experimental.utils import get_reward

    from lmforge.models import load_model

    ours = load_model(reward_dir).eval()
    seqs = [p + p[1:1 + 6 + 5 * k] for k, p in enumerate(prompts[:2])]
    width = max(len(s) for s in seqs)
    batch = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, width - len(s):] = torch.tensor(s)
    worst = 0.0
    with torch.no_grad():
        theirs = get_reward(scorer, batch, pad_id, width - 1)[0].squeeze(-1)  # [B, T]: every position
        for i, s in enumerate(seqs):
            mine = ours.scores(torch.tensor([s]))[0]
            worst = max(worst, float((mine - theirs[i, width - len(s):]).abs().max()))
    if worst > 1e-4:
        raise SystemExit(f"the two reward models disagree by {worst:.2e}: not the same model, nothing timed")
    return worst


def run_lmforge(data: Path, ckpt: Path, reward_dir: Path, work: Path, args) -> dict:
    import lmforge.recipes.ppo.data as ppo_data
    from lmforge.config import load_config
    from lmforge.train.loop import Trainer

    accum = args.replies // args.micro  # one optimizer step per epoch over the rollout, as TRL 1.12 takes
    cfg = load_config(values={
        "kind": "ppo", "name": "bench", "out_dir": str(work / "runs"),
        "recipe": {"reward_model": str(reward_dir), "prompts_per_rollout": args.replies,
                   "ppo_epochs": args.ppo_epochs, "max_new_tokens": args.max_new_tokens,
                   "temperature": args.temperature, "top_p": 1.0, "top_k": 0, "kl_coef": args.kl_coef,
                   "gamma": 1.0, "lam": 0.95, "clip": 0.2, "clip_value": 0.2, "vf_coef": 0.1,
                   "missing_eos_penalty": 1.0, "generation_batch_size": args.replies},
        "data": {"train_path": str(data), "seq_len": args.seq_len},
        "training": {"init_from": str(ckpt), "micro_batch_size": args.micro, "grad_accum_steps": accum,
                     "lr": args.lr, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0,
                     "beta1": 0.9, "beta2": 0.999, "max_steps": (args.warmup + args.steps) * args.ppo_epochs,
                     "device": "cpu", "precision": "fp32", "peak_flops": 1e12, "grad_clip": 1.0,
                     "activation_checkpointing": False},
        "logging": {"tensorboard": False, "progress_bar": False}})
    model, data_, devinfo, dist = cpu_run(cfg, ckpt)
    trainer = Trainer(cfg, model, data_, devinfo, dist, work / "runs" / "bench")  # value model <- reward model
    loader = data_.train
    steps_per_rollout = loader.batches_per_rollout // accum

    seen = {"replies": 0, "tokens": 0, "ended": 0, "prompt_tokens": 0, "score": 0.0, "rollouts": 0,
            "micro_batches": 0, "optimizer_steps": 0, "positions": 0, "real_positions": 0}
    clock = dict.fromkeys(PHASES + ("rollout",), 0.0)
    draw, next_batch, score = loader._draw, loader.next_batch, loader.rewards.score
    sample = ppo_data.sample

    def timed_sample(*a, **kw):
        t0 = time.perf_counter()
        out = sample(*a, **kw)
        clock["generation"] += time.perf_counter() - t0
        return out

    def timed_score(*a, **kw):  # the reward model, on the decoded replies
        t0 = time.perf_counter()
        out = score(*a, **kw)
        clock["scoring"] += time.perf_counter() - t0
        return out

    def timed_draw():  # a whole rollout: sampling, scoring, the three no-grad passes, GAE
        t0 = time.perf_counter()
        draw()
        clock["rollout"] += time.perf_counter() - t0
        buf = loader.buffer
        seen["replies"] += len(buf["completions"])
        seen["tokens"] += sum(len(c) for c in buf["completions"])  # a reply's tokens and its closing eos, if any
        seen["ended"] += round(buf["stats"]["eos_rate"] * len(buf["completions"]))
        seen["prompt_tokens"] += sum(len(loader.prompts.ids[p]) for p in buf["prompts"])
        seen["score"] += buf["stats"]["score"]
        seen["rollouts"] += 1

    def counted():
        batch = next_batch()
        seen["micro_batches"] += 1
        seen["positions"] += batch["input_ids"].numel()  # what the update's forwards and backwards run over
        seen["real_positions"] += int((batch["document_ids"] >= 0).sum())
        return batch

    loader._draw, loader.next_batch, loader.rewards.score = timed_draw, counted, timed_score
    trainer.optimizer.register_step_post_hook(lambda *a: seen.__setitem__("optimizer_steps",
                                                                          seen["optimizer_steps"] + 1))
    ppo_data.sample = timed_sample
    try:
        for _ in range(args.warmup * steps_per_rollout):
            trainer.step_once()
        if loader.handed != loader.batches_per_rollout:
            raise SystemExit(f"the warm-up ended inside a rollout ({loader.handed} of {loader.batches_per_rollout} "
                             "micro-batches handed): the timed window would not be whole rollouts")
        seen.update(dict.fromkeys(seen, 0))
        clock.update(dict.fromkeys(clock, 0.0))
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps * steps_per_rollout):
            trainer.step_once()
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        load = os.getloadavg()[0]
    finally:
        ppo_data.sample = sample
    profile = {"generation": clock["generation"], "scoring": clock["scoring"],
               "passes": clock["rollout"] - clock["generation"] - clock["scoring"],
               "update": seconds - clock["rollout"]}
    return summary("lmforge ppo (KV-cached engine, packed)", seen, seconds, profile, args,
                   prompts=len(loader.prompts.ids), padded_width=None, load=load, cpu_seconds=cpu_seconds)


def trl_dataset(data: Path, ckpt: Path, args) -> list[dict]:
    """TRL's rows: the ids lmforge prompts with (``encode_prompt``: eos + the chat template with the row's
    tools), those that leave room for ``--max-new-tokens`` in ``--seq-len``."""
    from lmforge.posttrain.rollout import encode_prompt
    from lmforge.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(ckpt / "tokenizer.json")
    out = []
    for line in (data / "train.jsonl").read_text().splitlines():
        ids = encode_prompt(tokenizer, json.loads(line))
        if len(ids) <= args.seq_len - args.max_new_tokens:
            out.append({"input_ids": ids})
    return out


def run_trl(data: Path, ckpt: Path, hf: Path, reward_dir: Path, work: Path, args) -> dict:
    import datasets
    import transformers
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    transformers.logging.set_verbosity_error()  # the load report of score.weight, which is set just below
    transformers.logging.disable_progress_bar()
    rows = trl_dataset(data, ckpt, args)
    ds = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    tokenizer.padding_side = "left"  # PPO's queries: generation continues them, so the padding goes first
    policy = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
    reward_model = trl_scorer(hf, reward_dir)
    value_model = trl_scorer(hf, reward_dir)
    worst = check_same_scores(reward_dir, reward_model, [r["input_ids"] for r in rows], tokenizer.pad_token_id)
    print(f"reward model check: lmforge and TRL scores agree to {worst:.1e} at every position")

    marks: dict[str, float] = {}
    seen = {"replies": 0, "tokens": 0, "ended": 0, "prompt_tokens": 0, "score": 0.0, "rollouts": 0,
            "micro_batches": 0, "optimizer_steps": 0, "positions": 0, "real_positions": 0, "width": 0}
    clock = dict.fromkeys(PHASES, 0.0)

    def timing() -> bool:
        return "t0" in marks and "t1" not in marks

    class Clock(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):  # once per rollout, before its on_step_end
            if args.warmup < state.global_step <= args.warmup + args.steps and logs and "objective/scores" in logs:
                seen["score"] += logs["objective/scores"]
                seen["rollouts"] += 1

        def on_step_end(self, a, state, control, **kw):  # once per rollout, after its updates
            if state.global_step == args.warmup:
                marks["t0"], marks["c0"] = time.perf_counter(), time.process_time()
            elif state.global_step == args.warmup + args.steps:
                marks["t1"], marks["c1"] = time.perf_counter(), time.process_time()
                marks["load"] = os.getloadavg()[0]

    generate = policy.generate

    def timed_generate(*a, **kw):  # the whole rollout's sampling (its scores are TRL's old log-probs)
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        if timing():
            clock["generation"] += time.perf_counter() - t0
            mask = kw["attention_mask"]
            replies = out.sequences[:, mask.shape[1]:]
            is_eos = replies == tokenizer.eos_token_id
            ended = is_eos.any(1)
            lengths = torch.where(ended, is_eos.int().argmax(1) + 1, replies.shape[1])  # up to its first eos
            seen["replies"] += replies.shape[0]
            seen["tokens"] += int(lengths.sum())
            seen["ended"] += int(ended.sum())
            seen["prompt_tokens"] += int(mask.sum())
            seen["width"] += mask.shape[1] + replies.shape[1]
        return out

    get_reward, forward = ppo_module.get_reward, ppo_module.forward

    def timed_get_reward(model, *a, **kw):  # the reward model's score, or the value model's values
        t0 = time.perf_counter()
        out = get_reward(model, *a, **kw)
        if timing():
            clock["scoring" if model is reward_model else "passes"] += time.perf_counter() - t0
        return out

    def timed_forward(model, *a, **kw):  # no grad: the reference's pass; with grad: an update's forward
        if torch.is_grad_enabled():
            if timing():  # one forward (policy and value model) per micro-batch, over padded sequences
                query_responses, pad_id = a[0], a[1]
                seen["micro_batches"] += 1
                seen["positions"] += query_responses.numel()
                seen["real_positions"] += int((query_responses != pad_id).sum())
            return forward(model, *a, **kw)
        t0 = time.perf_counter()
        out = forward(model, *a, **kw)
        if timing():
            clock["passes"] += time.perf_counter() - t0
        return out

    per_device = args.micro
    config = PPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=per_device,
                       gradient_accumulation_steps=args.replies // per_device, num_mini_batches=1,
                       total_episodes=(args.warmup + args.steps) * args.replies,
                       local_rollout_forward_batch_size=args.replies, num_sample_generations=0,
                       response_length=args.max_new_tokens, stop_token="eos", temperature=args.temperature,
                       missing_eos_penalty=1.0, num_ppo_epochs=args.ppo_epochs, whiten_rewards=False,
                       kl_coef=args.kl_coef, kl_estimator="k1", cliprange=0.2, cliprange_value=0.2, vf_coef=0.1,
                       gamma=1.0, lam=0.95, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                       weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, logging_steps=1,
                       save_strategy="no", report_to=[], use_cpu=True, bf16=False, dataloader_num_workers=0,
                       seed=0, disable_tqdm=True,
                       activation_checkpointing=False)  # PPOConfig's gradient_checkpointing (its alias) defaults on
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None,
                         reward_model=reward_model, train_dataset=ds, value_model=value_model, callbacks=[Clock()])
    if policy.is_activation_checkpointing or value_model.is_activation_checkpointing:
        raise SystemExit("TRL turned activation checkpointing on; lmforge runs without it")
    trainer.remove_callback(PrinterCallback)  # TRL logs every rollout; the table says what matters here

    def count_step(*a):
        if timing():
            seen["optimizer_steps"] += 1

    trainer.optimizer.optimizer.register_step_post_hook(count_step)  # the AdamW inside accelerate's wrapper
    policy.generate = timed_generate
    ppo_module.get_reward, ppo_module.forward = timed_get_reward, timed_forward
    try:
        trainer.train()
    finally:
        ppo_module.get_reward, ppo_module.forward = get_reward, forward
    seconds = marks["t1"] - marks["t0"]
    profile = {"generation": clock["generation"], "scoring": clock["scoring"], "passes": clock["passes"],
               "update": seconds - sum(clock.values())}
    return summary("TRL 1.12 PPOTrainer (transformers generate, padded)", seen, seconds, profile, args,
                   prompts=len(rows), padded_width=seen["width"] / args.steps, load=marks["load"],
                   cpu_seconds=marks["c1"] - marks["c0"])


def summary(system: str, seen: dict, seconds: float, profile: dict, args, prompts: int,
            padded_width: float | None, load: float, cpu_seconds: float) -> dict:
    n = seen["replies"]
    return {"system": system, "replies_per_s": n / seconds, "tokens_per_s": seen["tokens"] / seconds,
            "replies_per_cpu_s": n / cpu_seconds,
            "replies_per_rollout": n / args.steps, "tokens_per_reply": seen["tokens"] / n,
            "eos_rate": seen["ended"] / n, "prompt_tokens_per_reply": seen["prompt_tokens"] / n,
            "padded_width": padded_width,
            "optimizer_steps_per_rollout": seen["optimizer_steps"] / args.steps,
            "micro_batches_per_rollout": seen["micro_batches"] / args.steps,
            "positions_per_micro_batch": seen["positions"] / seen["micro_batches"],
            "real_positions_per_micro_batch": seen["real_positions"] / seen["micro_batches"],
            "score": seen["score"] / max(seen["rollouts"], 1), "seconds": seconds, "cpu_seconds": cpu_seconds,
            "seconds_per_rollout": seconds / args.steps,
            "profile_s_per_rollout": {k: v / args.steps for k, v in profile.items()}, "prompts": prompts,
            "load_average_1min": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed rollouts (each: sampling, scoring, passes, updates)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rollouts first (at least 1)")
    p.add_argument("--rows", type=int, default=500, help="training prompts written")
    p.add_argument("--replies", type=int, default=16, help="replies per rollout, one per prompt (both systems)")
    p.add_argument("--micro", type=int, default=8, help="replies per forward and backward (both systems)")
    p.add_argument("--ppo-epochs", type=int, default=4, help="passes over each rollout (one optimizer step each)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--kl-coef", type=float, default=0.05, help="per-token KL penalty to the frozen reference")
    p.add_argument("--lr", type=float, default=1e-6)
    add_model_args(p, 512, "the model's context; prompt + reply must fit")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the timed window starts at the end of the last warm-up rollout)")
    if args.replies % args.micro:
        p.error(f"--micro {args.micro} must divide --replies {args.replies} (whole micro-batches per epoch)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, ckpt, hf, reward_dir = prepare(work, args)
        results = [run_lmforge(data, ckpt, reward_dir, work, args), run_trl(data, ckpt, hf, reward_dir, work, args)]
    print(f"\nPPO throughput, {args.layers}x{args.width} llama (+ value and reward models alike), vocab {args.vocab}, "
          f"{args.replies} replies/rollout, {args.micro} per forward, {args.ppo_epochs} epochs, up to "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature:g}, kl_coef {args.kl_coef:g}, fp32, "
          f"{torch.get_num_threads()} threads, {cpu_name()}; {args.steps} timed rollouts after {args.warmup}")
    print(f"{'system':<52} {'replies/rollout':>15} {'opt steps x micro':>17} {'tokens/reply':>12} {'eos':>5} "
          f"{'prompt tokens/reply':>19} {'replies/s':>9} {'gen tokens/s':>12} {'score':>7}")
    for r in results:
        per_step = r["micro_batches_per_rollout"] / r["optimizer_steps_per_rollout"]
        steps = f"{r['optimizer_steps_per_rollout']:g} x {per_step:g}"
        print(f"{r['system']:<52} {r['replies_per_rollout']:>15.0f} {steps:>17} "
              f"{r['tokens_per_reply']:>12.1f} {r['eos_rate']:>5.0%} {r['prompt_tokens_per_reply']:>19.0f} "
              f"{r['replies_per_s']:>9.3f} {r['tokens_per_s']:>12,.1f} {r['score']:>7.3f}")
    print(f"\nseconds per rollout: {'total':>7} " + " ".join(f"{k:>10}" for k in PHASES))
    for r in results:
        prof = r["profile_s_per_rollout"]
        print(f"  {r['system'].split(' (')[0]:<19}{r['seconds_per_rollout']:>7.2f} "
              + " ".join(f"{prof[k]:>10.2f}" for k in PHASES))
    print("  (passes: the no-grad policy/reference/value forwards (+ GAE for lmforge); update: the ppo epochs' "
          "forward, backward and optimizer steps, and the rest)")
    print("positions per update micro-batch (real, i.e. not padding): " + " / ".join(
        f"{r['positions_per_micro_batch']:,.0f} ({r['real_positions_per_micro_batch']:,.0f}) {r['system'].split()[0]}"
        for r in results) + f"; TRL's padded width, prompt + reply: {results[1]['padded_width']:.0f}")
    print(f"(prompts that fit: {results[0]['prompts']:,} lmforge / {results[1]['prompts']:,} TRL)")
    print(f"(1-minute load average at the end of each timed window, this machine's other jobs included: "
          f"{results[0]['load_average_1min']:.2f} lmforge / {results[1]['load_average_1min']:.2f} TRL)")
    print(f"lmforge / TRL, replies/s including generation: "
          f"{results[0]['replies_per_s'] / results[1]['replies_per_s']:.2f}x (per CPU second of the process: "
          f"{results[0]['replies_per_cpu_s'] / results[1]['replies_per_cpu_s']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "cpu": cpu_name(), "results": results}, indent=2))


if __name__ == "__main__":
    main()

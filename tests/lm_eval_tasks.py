"""lm-evaluation-harness tasks from local files, a small model that learnt their facts, and lm_eval's own
``hf`` backend on that model's ``lmforge export --format hf``: what the harness tests (tests/test_harness.py)
and the server's lm_eval test compare against. Nothing here downloads anything.

The facts: each of 24 people lives in one of six cities and likes one of six foods. The model learns 16
people's facts (two short documents each, "Anna lives in Paris." / "Anna likes tea."); the other 8 are
held out, so on them it can only guess. Tasks (all over the same 24 people, held-out ones interleaved, so
``--limit`` keeps both kinds):

- ``local_mc`` (multiple_choice): context "Anna lives in " (the trailing space moves into the
  continuation, lm_eval's rule), six cities as choices; metrics acc, acc_norm.
- ``local_gen`` (generate_until): "Anna likes" -> " tea", ``until: ["."]``, 8 tokens at most; exact_match.
- ``local_ppl`` (loglikelihood_rolling): the learnt documents, and one longer than the model's context
  (several rolling windows); word_perplexity, byte_perplexity, bits_per_byte.

``write_missing_task`` adds ``local_missing``: a task whose data is a Hugging Face hub dataset that is not
in the local cache (for the offline-error test).

The lmforge convention these paths must agree on, token for token (docs/eval.md): a non-empty context is
encoded as it is (no separator before it); an empty context, and the first rolling window, start from the
document separator (eos). lm_eval's ``hf`` backend does exactly this on the export with
``prefix_token_id=<eos id>`` (``hf_model_args``); without it lm_eval would use the export's bos token
``<s>``, which opens chat turns in lmforge and never starts a pretraining document.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna"]
FOODS = ["tea", "rice", "soup", "bread", "cheese", "honey"]
NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Greta", "Hugo", "Iris", "Jonas", "Karin", "Leo",
         "Mila", "Nico", "Olga", "Paul", "Rosa", "Sven", "Tina", "Udo", "Vera", "Walter", "Xenia", "Yves"]
HELD_OUT = set(NAMES[2::3])  # every third person: 8 of 24, never seen in training
TASKS = ("local_mc", "local_gen", "local_ppl")
N_POSITIONS = 64  # the model's context: the long local_ppl document needs several rolling windows


def facts() -> list[dict[str, Any]]:
    """One record per person: name, city, food (seeded, fixed)."""
    rng = random.Random(18)
    return [{"name": n, "city": rng.choice(CITIES), "food": rng.choice(FOODS)} for n in NAMES]


def training_documents() -> list[str]:
    """What the model learns: two documents per person not held out."""
    docs = []
    for f in facts():
        if f["name"] not in HELD_OUT:
            docs += [f"{f['name']} lives in {f['city']}.", f"{f['name']} likes {f['food']}."]
    return docs


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _json_dataset(path: Path, cache: Path) -> dict[str, Any]:
    """lm_eval's task keys for a local JSONL file, read by `datasets`' json builder (no hub access); its
    prepared copy goes under ``cache`` rather than the user's ~/.cache."""
    return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}, "cache_dir": str(cache)},
            "test_split": "test"}


def write_tasks(directory: Path) -> Path:
    """Write the three local tasks (YAML configs and their JSONL data) into ``directory``; returns it.
    Pass it as ``--include-path`` / ``TaskManager(include_path=...)``."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    cache = directory / "hf_datasets_cache"
    rows = [{**f, "choices": CITIES, "label": CITIES.index(f["city"]), "held_out": f["name"] in HELD_OUT}
            for f in facts()]
    (directory / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    learnt = training_documents()
    long_doc = " ".join(learnt)  # ~200 tokens: longer than N_POSITIONS
    texts = [learnt[0], learnt[1] + " " + learnt[2], long_doc, "Vera lives in Rome."]
    (directory / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    facts_data = _json_dataset(directory / "facts.jsonl", cache)
    (directory / "local_mc.yaml").write_text(_yaml({
        "task": "local_mc", **facts_data, "output_type": "multiple_choice",
        # The trailing space is moved into each continuation by lm_eval (" Paris"), as in its own tasks.
        "doc_to_text": "{{name}} lives in ", "target_delimiter": "", "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0}}))
    (directory / "local_gen.yaml").write_text(_yaml({
        "task": "local_gen", **facts_data, "output_type": "generate_until",
        "doc_to_text": "{{name}} likes", "doc_to_target": " {{food}}",
        "generation_kwargs": {"until": ["."], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0}}))
    (directory / "local_ppl.yaml").write_text(_yaml({
        "task": "local_ppl", **_json_dataset(directory / "ppl.jsonl", cache), "output_type": "loglikelihood_rolling",
        "doc_to_text": "", "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}],
        "metadata": {"version": 1.0}}))
    return directory


MISSING_DATASET = "lmforge-tests/no-such-dataset"


def write_missing_task(directory: Path) -> Path:
    """``local_missing``: a multiple-choice task on the hub dataset ``MISSING_DATASET`` (subset ``facts``),
    which no cache holds; with HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1 loading it fails at once."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "local_missing.yaml").write_text(_yaml({
        "task": "local_missing", "dataset_path": MISSING_DATASET, "dataset_name": "facts", "test_split": "test",
        "output_type": "multiple_choice", "doc_to_text": "{{name}} lives in", "doc_to_choice": "choices",
        "doc_to_target": "label", "metric_list": [{"metric": "acc"}], "metadata": {"version": 1.0}}))
    return directory


def task_manager(directory: Path, include_defaults: bool = False):
    """lm_eval's TaskManager over the local tasks in ``directory``. Without the built-in tasks by default:
    indexing lm_eval's ~15,000 task configs takes seconds, and these tests need none of them."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(directory), include_defaults=include_defaults)


def train_facts_model(out: Path, flavor: str = "llama", steps: int = 300, seed: int = 0) -> Path:
    """A tiny GPT that has learnt ``training_documents`` (the held-out people excepted), saved with its
    tokenizer at ``out/ckpt``; returns that directory. Trained as lmforge pretrains: the documents,
    shuffled, joined by the separator (eos) into one stream, cut into windows at random offsets, so a
    document may start a window or follow its separator. ~5 s on one busy CPU core."""
    from lmforge.models.gpt import GPT, GPTConfig
    from lmforge.tokenizer import Tokenizer, train_tokenizer

    docs = training_documents()
    corpus = docs + [f"{f['name']} lives in {f['city']}. {f['name']} likes {f['food']}." for f in facts()]
    tokenizer = Tokenizer.load(train_tokenizer(corpus * 4, vocab_size=320, out_dir=out / "tokenizer",
                                               show_progress=False, overwrite=True))
    encoded = [tokenizer.encode(d) for d in docs]
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(flavor=flavor, vocab_size=tokenizer.vocab_size, n_positions=N_POSITIONS, n_embd=64,
                          n_layer=2, n_head=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    window, rows = 32, 16
    for step in range(steps):
        order = encoded[:]
        rng.shuffle(order)
        stream = torch.tensor([t for ids in order for t in (tokenizer.eos_id, *ids)] * 2)
        starts = torch.randint(0, len(stream) // 2, (rows,), generator=g)
        batch = torch.stack([stream[s:s + window + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / steps))
        loss, _ = model({"input_ids": batch[:, :-1], "labels": batch[:, 1:]})
        opt.zero_grad()
        loss.backward()
        opt.step()
    ckpt = model.save_pretrained(out / "ckpt")
    tokenizer.save(ckpt)
    return ckpt


def export(checkpoint: Path, out: Path) -> Path:
    """``lmforge export CKPT --format hf --out OUT``."""
    from lmforge.export import export_hf

    return export_hf(checkpoint, out, overwrite=True)


def hf_model_args(export_dir: Path) -> dict[str, Any]:
    """lm_eval ``hf`` model_args that score the export as lmforge does: fp32, and the separator (eos) as
    the prefix of an empty context and of the first rolling window."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    return {"pretrained": str(export_dir), "dtype": "float32", "prefix_token_id": config["eos_token_id"]}


def local_completions_model_args(base_url: str, export_dir: Path, model: str = "tiny") -> dict[str, Any]:
    """lm_eval ``local-completions`` model_args for a `lmforge serve` of the same checkpoint that agree
    with ``hf_model_args`` token for token: token-id prompts from the export's tokenizer, no special
    tokens added, the separator as the empty-context prefix, the model's context as max_length.
    (Rolling windows of long documents still differ: lm_eval's API backend cuts them 2 tokens shorter.)"""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    context = config.get("n_positions") or config.get("max_position_embeddings")
    return {"model": model, "base_url": f"{base_url.rstrip('/')}/v1/completions", "tokenizer": str(export_dir),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "add_bos_token": False,
            "custom_prefix_token_id": config["eos_token_id"], "max_length": context, "num_concurrent": 1,
            "max_retries": 1}


def run_lm_eval(model: str | Any, model_args: dict[str, Any] | None, tasks: list[str] | tuple[str, ...],
                tasks_dir: Path, limit: int | None = None, batch_size: int = 8, device: str = "cpu",
                use_cache: str | None = None) -> dict[str, Any]:
    """lm_eval's ``simple_evaluate`` on the local tasks, with per-sample results (``log_samples``), no
    bootstrap; returns its results dict."""
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), task_manager=task_manager(tasks_dir),
                           limit=limit, batch_size=batch_size, device=device, log_samples=True, bootstrap_iters=0,
                           use_cache=use_cache, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                           fewshot_random_seed=0)


def run_hf(export_dir: Path, tasks: list[str] | tuple[str, ...], tasks_dir: Path, limit: int | None = None,
           batch_size: int = 8, device: str = "cpu") -> dict[str, Any]:
    """lm_eval's own ``hf`` backend on an HF export (``export``) with ``hf_model_args``."""
    return run_lm_eval("hf", hf_model_args(export_dir), tasks, tasks_dir, limit, batch_size, device)


def per_sample(results: dict[str, Any], task: str) -> list[Any]:
    """Each sample's raw model answers, in document order: for multiple_choice one (log-likelihood,
    is_greedy) per choice, for generate_until the generated text, for loglikelihood_rolling the
    document's log-likelihood."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    out = []
    for s in samples:
        resps = [r[0] if isinstance(r, list) and len(r) == 1 else r for r in s["resps"]]
        out.append(resps if len(resps) > 1 else resps[0])
    return out

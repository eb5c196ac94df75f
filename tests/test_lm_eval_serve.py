"""lm-evaluation-harness against a real `lmforge serve` on loopback (its `local-completions` backend),
and against its own `hf` backend on lmforge's HF export of the same checkpoint: the same answers, sample
by sample, on a local multiple-choice task and a local generate_until task (tests/lm_eval_tasks.py)."""

from __future__ import annotations

import pytest

from .lm_eval_tasks import export, local_completions_model_args, per_sample, run_hf, run_lm_eval, train_facts_model
from .lm_eval_tasks import write_tasks
from .serve_helpers import Server

TASKS = ("local_mc", "local_gen")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_serve")
    checkpoint = train_facts_model(root)
    return checkpoint, export(checkpoint, root / "hf"), write_tasks(root / "tasks")


def test_lm_eval_through_the_server_equals_its_hf_backend_on_the_export(setup):
    checkpoint, hf_dir, tasks = setup
    server = Server(checkpoint, "--max-batch-size", "8")
    try:
        served = run_lm_eval("local-completions", local_completions_model_args(server.base, hf_dir), TASKS, tasks,
                             batch_size=8)
    finally:
        server.stop()
    direct = run_hf(hf_dir, TASKS, tasks)
    for task in TASKS:
        got, want = per_sample(served, task), per_sample(direct, task)
        assert len(got) == len(want) == 24
        if task == "local_gen":
            assert got == want  # the generated text, sample by sample
        else:
            for g, w in zip(got, want):  # each choice's (log-likelihood, is_greedy)
                assert [float(x[0]) for x in g] == pytest.approx([float(x[0]) for x in w], abs=1e-4)
                assert [bool(x[1]) for x in g] == [bool(x[1]) for x in w]
    mc_served, mc_direct = served["results"]["local_mc"], direct["results"]["local_mc"]
    assert mc_served["acc,none"] == mc_direct["acc,none"] and mc_served["acc_norm,none"] == mc_direct["acc_norm,none"]
    assert served["results"]["local_gen"]["exact_match,none"] == direct["results"]["local_gen"]["exact_match,none"]
    # The model learnt 16 of the 24 people: better than chance (1/6) on the choices, some foods right.
    assert mc_served["acc,none"] > 0.4 and served["results"]["local_gen"]["exact_match,none"] > 0.3

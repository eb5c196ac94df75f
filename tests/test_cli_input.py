"""Bad input on the command line is refused up front, with messages that name the user's option and the fix."""

from __future__ import annotations

import pytest

from lmforge.cli import build_parser, main


def _option(verb: str, option: str):
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return next(a for a in sub.choices[verb]._actions if option in a.option_strings)


@pytest.mark.parametrize("minutes", ["nan", "inf"])
def test_quickstart_refuses_non_finite_minutes_before_any_work(minutes, tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--minutes", minutes, "--data", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--minutes must be a finite number > 0, got {minutes}" in err
    assert not out.exists()  # no tokenizer, no data


@pytest.mark.parametrize("verb", ["generate", "chat"])
@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", "1.5"])
def test_seed_outside_torchs_range_is_refused_by_the_parser(verb, seed, trained_run, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([verb, str(trained_run.run_dir), "--seed", seed])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seed" in err and ("2**64-1" in err or "--seed 0" in err)
    assert "Overflow" not in err


@pytest.mark.parametrize("option", ["--tool-calls", "--preferences", "--prompts"])
def test_eval_data_with_an_option_that_names_its_own_data_is_refused(option, trained_run, tmp_path, capsys):
    assert main(["eval", str(trained_run.run_dir), "--data", str(tmp_path), option, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--data cannot be combined with {option}" in err and "drop --data" in err


def test_eval_of_a_language_model_on_a_puzzle_dataset_names_both(trained_run, tmp_path, capsys):
    from lmforge.recipes.puzzles.sudoku import build_sudoku_dataset, generate_puzzles

    puzzles = generate_puzzles(4, 30, 36, seed=3, show_progress=False, workers=1)
    sudoku = tmp_path / "sudoku"
    build_sudoku_dataset(sudoku, puzzles, puzzles, num_aug=0, seed=0, show_progress=False)
    assert main(["eval", str(trained_run.run_dir), "--data", str(sudoku), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "is a puzzle dataset" in err and "holds a language model" in err and "include globs" not in err


def test_chat_max_new_tokens_0_names_the_option(trained_run, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(trained_run.run_dir), "--max-new-tokens", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens must be >= 1, got 0" in err and "max_tokens" not in err


@pytest.mark.parametrize("vocab", ["0", "3"])
def test_bench_vocab_size_too_small_names_the_flag(vocab, capsys):
    assert main(["bench", "go_coder_tiny", "--vocab-size", vocab, "--steps", "1", "--warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert "--vocab-size must be >= 4" in err and f"got {vocab}" in err and "model.vocab_size" not in err


def test_log_samples_help_says_where_the_samples_go():
    help_text = _option("eval", "--log-samples").help
    assert "RUN_DIR/eval/" in help_text and "--json prints the results without them" in help_text


def test_generate_of_a_prompt_longer_than_the_context_gives_the_tokens_asked_for(trained_run, tmp_path, capsys):
    from lmforge.infer.generate import generate_tokens
    from lmforge.infer.loading import load_for_inference

    model, tok, _ = load_for_inference(str(trained_run.run_dir), "cpu", "fp32")
    prompt = "func main() { fmt.Println(x) }\n" * 20
    ids = [tok.eos_id, *tok.encode(prompt)]
    assert len(ids) > model.config.n_positions
    (tmp_path / "prompt.go").write_text(prompt)
    code = main(["generate", str(trained_run.run_dir), "--prompt-file", str(tmp_path / "prompt.go"),
                 "--max-new-tokens", "5", "--temperature", "0", "--no-stop-at-eos", "--device", "cpu",
                 "--precision", "fp32"])
    out, err = capsys.readouterr()
    assert code == 0
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert notes and "keeping its last" in notes[0] and "5 new tokens asked for fit" in notes[0]
    assert "UserWarning" not in err
    new = list(generate_tokens(model, ids, 5, temperature=0.0, stop_at_eos=False, note=lambda message: None))
    assert len(new) == 5
    assert out == prompt + tok.decode(new) + "\n"


def test_seed_option_takes_the_whole_range_torch_does():
    assert _option("generate", "--seed").type("18446744073709551615") == 2**64 - 1

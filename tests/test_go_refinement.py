"""Refinement states for HRGC's continue/refine/done head: labels right by construction, corruptions
really rejected by a parser or really off the plan."""

from __future__ import annotations

import random
import shutil
import subprocess
from collections import Counter

from lmforge.go_syntax import go_parser, validate
from lmforge.recipes.hrgc.functions import functions_in_file
from lmforge.recipes.hrgc.refinement import CORRUPTIONS, corrupt, refinement_examples

SOURCE = '''package files

// ReadFile reads the named file.
func ReadFile(name string) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(f)
	return data, err
}

func (s *Store) Keys(
	prefix string,
) []string {
	out := make([]string, 0, len(s.m))
	for k := range s.m {
		if strings.HasPrefix(k, prefix) {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}
'''


def functions():
    return functions_in_file(go_parser(), SOURCE, "files/a.go", "files", Counter())


def gofmt_accepts(spec: str, code: str, tmp_path) -> bool:
    path = tmp_path / "check.go"
    path.write_text("package p\n\n" + spec + " " + code + "\n")  # the doc comment is valid Go too
    return subprocess.run(["gofmt", "-e", "-l", str(path)], capture_output=True).returncode == 0


def test_the_real_bodies_validate_and_label_done(tmp_path):
    parser = go_parser()
    for fn in functions():
        if shutil.which("gofmt"):
            assert gofmt_accepts(fn.spec, fn.code, tmp_path)
        examples = refinement_examples(parser, fn, random.Random(0))
        done = [e for e in examples if e.label == "done"]
        assert len(done) == 1 and done[0].attempt == fn.code and done[0].message == ""
        assert validate(parser, fn.spec, fn.code, fn.plan) == ""


def test_every_corruption_really_fails_a_parser_or_the_plan(tmp_path):
    parser = go_parser()
    seen = Counter()
    for fn in functions():
        for seed in range(5):
            for kind in CORRUPTIONS:
                found = corrupt(parser, fn, kind, random.Random(seed))
                if found is None:
                    continue
                attempt, message = found
                seen[kind] += 1
                assert attempt != fn.code and message
                if message.startswith("syntax error"):
                    if shutil.which("gofmt"):  # Go's own parser agrees
                        assert not gofmt_accepts(fn.spec, attempt, tmp_path)
                else:
                    assert message.startswith("does not follow the plan")
                    assert validate(parser, fn.spec, attempt) == ""  # it parses: only the plan is broken
    assert set(seen) == set(CORRUPTIONS)  # each kind applies to these functions


def test_continue_states_are_prefixes_cut_at_a_statement():
    parser = go_parser()
    for fn in functions():
        for seed in range(5):
            (prefix,) = [e for e in refinement_examples(parser, fn, random.Random(seed)) if e.label == "continue"]
            assert fn.code.startswith(prefix.attempt.rstrip("\n")) and len(prefix.attempt) < len(fn.code)
            last_line = prefix.attempt.rstrip("\n").split("\n")[-1].strip()
            assert last_line and any(line.strip() == last_line for line in fn.code.split("\n"))
            assert prefix.message  # unfinished code does not validate, yet its label is continue
            assert prefix.target == fn.code


def test_refine_states_target_the_real_body_and_are_reproducible():
    parser = go_parser()
    fn = functions()[1]
    a = refinement_examples(parser, fn, random.Random(3))
    b = refinement_examples(parser, fn, random.Random(3))
    assert a == b
    refine = [e for e in a if e.label == "refine"]
    assert refine and all(e.target == fn.code and e.attempt != fn.code for e in refine)
    assert {e.label for e in a} == {"done", "continue", "refine"}


def test_a_function_that_does_not_stand_alone_gives_no_states():
    parser = go_parser()
    fn = functions()[0]
    broken = type(fn)(**{**fn.__dict__, "code": fn.code[:-1]})  # the closing brace lost
    assert refinement_examples(parser, broken, random.Random(0)) == []

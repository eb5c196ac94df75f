"""Shared pytest fixtures, and the test run's thread and worker counts."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# One compute thread per test process, and for the processes the tests start (servers, torchrun ranks):
# the models here are tiny, so a second thread gains little, and on a busy machine OpenMP threads that
# spin-wait for each other made steps ~7x slower. The run is spread over processes instead (pytest-xdist).
os.environ["OMP_NUM_THREADS"] = "1"
# The measured matmul peak is cached per machine (lmforge.device); tests keep theirs to themselves.
os.environ["LMFORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="lmforge-test-cache-")
atexit.register(shutil.rmtree, os.environ["LMFORGE_CACHE_DIR"], True)
import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads when it starts its thread pool)

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def go_data(tmp_path_factory) -> Path:
    """Token shards of a small generated Go corpus: ``go_data.parent`` holds corpus/, tokenizer/ and
    data/ (this). Built once per test process; read-only (copy it to change it)."""
    from tests.train_helpers import make_prepared_data

    return make_prepared_data(tmp_path_factory.mktemp("go_data"))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, go_data):
    """A tiny GPT trained 30 steps on ``go_data`` (evaluated at steps 15 and 30; checkpoints step-000020,
    step-000030 and best): its ``TrainResult``. Built once per test process; read-only (copy what a
    test changes)."""
    from lmforge.config import load_config
    from lmforge.train import train
    from tests.train_helpers import write_recipe

    base = tmp_path_factory.mktemp("trained_run")
    recipe = write_recipe(base / "r.yaml", go_data, base / "runs", training={"max_steps": 30, "eval_interval": 15})
    return train(load_config(str(recipe)))


@pytest.fixture(scope="session")
def tool_sft(tmp_path_factory):
    """A tiny llama model fine-tuned (sft kind) on generated tool-calling conversations: ``.data``
    (train/val/test.jsonl), ``.base`` (before), ``.checkpoint`` (after), ``.tokenizer``. Built once per
    test process; read-only."""
    from tests.posttrain_helpers import make_tool_sft_checkpoint

    return make_tool_sft_checkpoint(tmp_path_factory.mktemp("tool_sft"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (each holds its own torch and builds its files' fixtures)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


# --- go_corpus: a small Go module tree with the files the data filters must keep or skip ----------

GO_KEPT = {
    "main.go": '''package main

import (
	"flag"
	"fmt"
	"os"

	"example.com/shop/server"
)

func main() {
	addr := flag.String("addr", ":8080", "listen address")
	flag.Parse()
	if err := server.Run(*addr); err != nil {
		fmt.Fprintf(os.Stderr, "shop: %v\\n", err)
		os.Exit(1)
	}
}
''',
    "server/handler.go": '''// Package server serves the shop's HTTP API.
package server

import (
	"encoding/json"
	"net/http"
	"sync"
)

// Item is one product on sale.
type Item struct {
	ID    int     `json:"id"`
	Name  string  `json:"name"`
	Price float64 `json:"price"`
}

type store struct {
	mu    sync.RWMutex
	items map[int]Item
}

func (s *store) list(w http.ResponseWriter, r *http.Request) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]Item, 0, len(s.items))
	for _, it := range s.items {
		out = append(out, it)
	}
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(out); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
	}
}

// Run starts the server and blocks until it fails.
func Run(addr string) error {
	s := &store{items: map[int]Item{1: {ID: 1, Name: "café crème ☕", Price: 2.5}}}
	mux := http.NewServeMux()
	mux.HandleFunc("/items", s.list)
	return http.ListenAndServe(addr, mux)
}
''',
    "server/handler_test.go": '''package server

import (
	"net/http/httptest"
	"testing"
)

func TestList(t *testing.T) {
	s := &store{items: map[int]Item{}}
	rec := httptest.NewRecorder()
	s.list(rec, httptest.NewRequest("GET", "/items", nil))
	if rec.Code != 200 {
		t.Fatalf("status = %d, want 200", rec.Code)
	}
}
''',
    "internal/textutil/wrap.go": '''package textutil

import "strings"

// Wrap breaks s into lines of at most width runes, splitting on spaces.
func Wrap(s string, width int) []string {
	var lines []string
	var b strings.Builder
	for _, word := range strings.Fields(s) {
		if b.Len() > 0 && b.Len()+1+len(word) > width {
			lines = append(lines, b.String())
			b.Reset()
		}
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(word)
	}
	if b.Len() > 0 {
		lines = append(lines, b.String())
	}
	return lines
}
''',
    # The generated marker only counts before the package clause, so this file is kept.
    "internal/textutil/doc.go": '''package textutil

// Tools may print lines such as the one below; writing it here does not make this file generated.
/*
// Code generated by hand. DO NOT EDIT.
*/
const Version = "1.2.0"
''',
}

GO_SKIPPED = {  # relative path -> the reason the filters must give
    "api/shop.pb.go": ("generated", '''// Code generated by protoc-gen-go. DO NOT EDIT.
// source: shop.proto

package api

type ItemRequest struct {
	Id int64
}
'''),
    "vendor/github.com/acme/log/log.go": ("vendor", '''package log

func Printf(format string, args ...any) {}
'''),
    "server/testdata/golden.go": ("testdata", '''package golden

var Want = []string{"a", "b"}
'''),
    "internal/empty.go": ("empty", "\n\n  \n"),
}


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


@pytest.fixture
def go_corpus(tmp_path: Path) -> Path:
    """A Go module tree: GO_KEPT files (one is a _test.go) plus one file for each GO_SKIPPED reason."""
    root = tmp_path / "shop"
    write_files(root, GO_KEPT)
    write_files(root, {rel: text for rel, (_, text) in GO_SKIPPED.items()})
    (root / "README.md").write_text("# shop\n", encoding="utf-8")  # not matched by **/*.go
    return root

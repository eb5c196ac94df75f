"""Byte-level BPE tokenizer: training, loading, and the files that tie it to Hugging Face.

Byte-level means every UTF-8 byte is in the base vocabulary, so ``decode(encode(s)) == s`` for any
text (Go code, tabs, emoji) and ``<unk>`` never appears. There is no normalizer and no prefix space for
the same reason. The special tokens always take ids 0..5 so that data shards, models and the user's
guide agree on ``bos=1, eos=2, pad=3`` without looking anything up.

``save`` writes ``tokenizer.json`` (the Rust tokenizer), ``tokenizer_config.json`` and
``special_tokens_map.json``, which is what ``transformers.AutoTokenizer.from_pretrained(dir)`` needs.
The chat template (``lmforge.chat``) travels in ``tokenizer_config.json`` as ``chat_template``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from lmforge.errors import LMForgeError
from lmforge.files import atomic_file, reporting_write_faults

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<PR_TITLE>", "<PR_BODY>"]
UNK, BOS, EOS, PAD = SPECIAL_TOKENS[:4]
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # all bytes + the specials, before any merge
DEFAULT_TRAINED_VOCAB = 8192  # a run that trains its own tokenizer, with model.vocab_size 0
# What the chat template is rendered on to find its own markers (``Tokenizer.special_spellings``): words that
# spell no added token of any tokenizer worth protecting
_PROBE_CHAT = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello"},
               {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}]
_CALL_ID = "call00000"  # nine letters and digits: Mistral's templates refuse any other shape of id


def _probe_call(arguments: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": _CALL_ID, "type": "function", "function": {"name": "probe", "arguments": arguments}}]}]


# the arguments as an object, then as its JSON text (DeepSeek-R1's template joins them to its markers as text)
_PROBE_CALLS = (_probe_call({}), _probe_call("{}"))
# and the tool's result after the call: the markers around a tool turn (Qwen's "<tool_response>")
_PROBE_RESULTS = tuple([*call, {"role": "tool", "tool_call_id": _CALL_ID, "name": "probe", "content": "Done"}]
                       for call in _PROBE_CALLS)
# A marker has 3 characters or more, one of them neither a letter, a digit, "_" nor whitespace ("<|im_end|>",
# "[INST]"): an added word, a run of spaces or a newline that some code tokenizers add and a template happens
# to write (between turns, after "user") is text's
_MARKER_LIKE = re.compile(r"^(?=.*[^\w\s]).{3,}$", re.DOTALL)


# Names that other tokenizers commonly give their special tokens, most common first; used when a
# foreign tokenizer's directory has no tokenizer_config.json / special_tokens_map.json naming them.
COMMON_SPECIALS = {
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
}


class Tokenizer:
    """A tokenizer: a thin, validated wrapper over a ``tokenizers.Tokenizer``.

    lmforge's own (``lmforge tokenizer train``) have the special tokens at ids 0..5. Any other
    ``tokenizer.json`` works too, e.g. a local copy of a Hugging Face tokenizer: its special tokens are
    read from ``tokenizer_config.json`` / ``special_tokens_map.json`` beside it, or found by their usual
    names; it needs an end-of-sequence token (the document separator), and pad falls back to it.
    """

    def __init__(self, backend: _RustTokenizer, origin: str = "<in memory>",
                 special_names: dict[str, str | None] | None = None, chat_template: str | None = None):
        from lmforge.chat import CHAT_TEMPLATE

        self._backend = backend
        self.chat_template = chat_template or CHAT_TEMPLATE
        self.origin = origin  # the file it was loaded from, for messages and overlap checks
        self._canonical = backend.to_str()  # compact serialization: file formatting never changes the hash
        native = all(backend.token_to_id(token) == i for i, token in enumerate(SPECIAL_TOKENS))
        self.is_native = native and not special_names
        if self.is_native:
            self.special_tokens: dict[str, str | None] = {"unk": UNK, "bos": BOS, "eos": EOS, "pad": PAD}
        else:
            self.special_tokens = self._foreign_specials(special_names or {})
        self._ids = {role: (None if t is None else backend.token_to_id(t)) for role, t in self.special_tokens.items()}
        # A foreign tokenizer without a template of its own borrows lmforge's for serving; fine-tuning
        # on chats needs to know whether the template is really the one the model will be prompted with.
        self.has_chat_template = bool(chat_template) or self.is_native
        self._bytes: list[bytes] | None = None  # token_bytes' table, built on first use
        self._text_lengths: np.ndarray | None = None  # text_bytes' table, built on first use
        self._longest: int | None = None  # max_chars' longest token in bytes
        # The control tokens' spellings and ids (``special_spellings``), and (built on first use) a copy of the
        # backend that encodes their spellings as plain text: encode_markup's. Kept per chat template.
        self._added = {t.content: (i, t.special) for i, t in backend.get_added_tokens_decoder().items() if t.content}
        self._controls: _Controls | None = None

    def _foreign_specials(self, named: dict[str, str | None]) -> dict[str, str | None]:
        vocab = self._backend.get_vocab(with_added_tokens=True)
        out: dict[str, str | None] = {}
        for role, candidates in COMMON_SPECIALS.items():
            token = named.get(role)
            if token is not None and token not in vocab:
                raise LMForgeError(f"{self.origin}: its config names {token!r} as the {role} token, but the "
                                   "vocabulary has no such token; fix tokenizer_config.json")
            out[role] = token if token is not None else next((c for c in candidates if c in vocab), None)
        if out["eos"] is None:
            raise LMForgeError(
                f"{self.origin}: no end-of-sequence token found (lmforge separates documents with it). Name "
                "it in tokenizer_config.json beside tokenizer.json (\"eos_token\": \"...\"), or train a "
                "tokenizer with `lmforge tokenizer train`.")
        if out["pad"] is None:
            out["pad"] = out["eos"]  # what the RLM-mHC guide does for tokenizers without one
        return out

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, or the directory that holds one (lmforge's or any HF tokenizer's)."""
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            hint = (" (a slow, sentencepiece-only tokenizer has no tokenizer.json: save it once with "
                    "transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) to write one)"
                    if path.is_dir() and (path / "tokenizer.model").is_file() else "")
            raise LMForgeError(
                f"tokenizer not found: {file} does not exist{hint}. Pass a tokenizer.json or its directory "
                "(`lmforge tokenizer train --out DIR` writes one).")
        try:
            backend = _RustTokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception for any parse problem
            with open(file, "rb") as f:
                json_text = f.read(64).lstrip().startswith(b"{")
            if file.suffix == ".model" or not json_text:
                raise LMForgeError(
                    f"{file} is not a tokenizer.json (a SentencePiece .model, or another binary format?). lmforge "
                    "reads Hugging Face tokenizer.json files: pass the tokenizer.json a Hugging Face tokenizer's "
                    "directory holds, or train one on your corpus with `lmforge tokenizer train SOURCES --out DIR` "
                    "(seed 001's tokenizer step)") from e
            raise LMForgeError(f"{file} is damaged: not a valid tokenizer file ({e}). {_restore_advice(file)}") from e
        return cls(backend, origin=str(file), special_names=_configured_specials(file.parent),
                   chat_template=_configured_chat_template(file.parent))

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def unk_id(self) -> int | None:
        return self._ids["unk"]

    @property
    def bos_id(self) -> int | None:
        """The beginning-of-sequence id; None for a foreign tokenizer that has none."""
        return self._ids["bos"]

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    @property
    def special_spellings(self) -> list[str]:
        """The spellings of the control tokens, longest first: the added tokens that chat text (``chat_markup``)
        protects, so that a message spelling one is text and only the template's own are these tokens.

        They are the added tokens flagged ``special``, and, flagged or not, those the chat template and generation
        rely on: the bos/eos/pad/unk tokens (generation stops at eos), lmforge's own special tokens, and the added
        tokens the template writes around the turns of a plain conversation (a foreign template's turn markers,
        as DeepSeek-R1's unflagged "<｜User｜>"). Many Hugging Face tokenizers have such tokens without the flag;
        leaving them out let a user close their turn with the eos spelling and forge a system or assistant turn.
        Added tokens the template only reads in messages (Qwen3's unflagged "<think>", which it finds in an
        assistant's content and strips) are not protected, or the template would no longer find them."""
        return self._control_tokens().spellings

    def _control_tokens(self) -> _Controls:
        if self._controls is None or self._controls.template != self.chat_template:
            template = self.chat_template
            relied_on = {t for t in self.special_tokens.values() if t is not None}
            relied_on |= set(SPECIAL_TOKENS if self.is_native else ())
            written = self._template_markers(template, relied_on)
            ids = {s: i for s, (i, flagged) in self._added.items() if flagged or s in relied_on or s in written}
            spellings = sorted(ids, key=len, reverse=True)
            pattern = re.compile("(" + "|".join(re.escape(s) for s in spellings) + ")") if spellings else None
            self._controls = _Controls(template, spellings, ids, pattern)
        return self._controls

    def _template_markers(self, template: str, relied_on: set[str]) -> set[str]:
        """The unflagged added tokens shaped like markers that ``template`` writes itself and does not read in
        messages: written, as found by rendering a plain conversation (nothing of the probe's words spells them)
        and one with a tool call (a template that cannot render the first, one that refuses system turns say, is
        tried without the system turn; one that cannot render a probe adds nothing from it); read, as
        ``_read_by_template`` finds (Qwen3's "<think>", which it writes before a reply and looks for in an
        assistant's content)."""
        from lmforge.chat import render_chat

        unflagged = [s for s, (_, flagged) in self._added.items()
                     if not flagged and s not in relied_on and _MARKER_LIKE.match(s.strip())]
        if not unflagged:
            return set()
        bos = self.special_tokens.get("bos") or ""
        eos = self.special_tokens.get("eos") or ""
        written: set[str] = set()
        rendered = False
        for probes in ((_PROBE_CHAT, _PROBE_CHAT[1:]), _PROBE_CALLS, _PROBE_RESULTS):
            for probe in probes:
                try:
                    text = render_chat(probe, bos, eos, template=template)
                except LMForgeError:
                    continue
                written |= {s for s in unflagged if s in text}
                rendered = True
                break
        if not rendered:
            warnings.warn(f"the chat template renders none of the conversations lmforge probes it with, so its "
                          f"added tokens without the special flag ({', '.join(sorted(unflagged)[:8])}) are not "
                          "protected: a message that spells one is that token. Check the template renders a "
                          "plain system/user/assistant conversation (lmforge chat, or apply_chat_template)",
                          stacklevel=4)
        return written - _read_by_template(template, written, bos, eos)

    def _plain_backends(self, controls: _Controls) -> tuple[_RustTokenizer, _RustTokenizer]:
        """Copies of the backend that encode the spellings of ``controls`` as text (each is flagged special in
        them: ``encode_special_tokens`` makes only flagged ones text; an unflagged added token is matched
        regardless): one for the text at the start of a markup, one for the text after a control token. They
        differ where a Metaspace pre-tokenizer puts its "▁" before the first word of the input only
        (``prepend_scheme: first``): encoded in one pass, a marker splits the input and the text after it
        gets none; encoded alone, it would."""
        if controls.plain is None:
            data = json.loads(self._backend.to_str())
            for token in data.get("added_tokens") or []:
                if token.get("content") in controls.ids:
                    token["special"] = True
            first = _RustTokenizer.from_str(json.dumps(data))
            if _metaspace_first_only(data.get("pre_tokenizer")):  # (now "never" in data)
                rest = _RustTokenizer.from_str(json.dumps(data))
            else:
                rest = first
            for backend in (first, rest):
                backend.encode_special_tokens = True
            controls.plain = (first, rest)
        return controls.plain

    def _encode_unmarked(self, controls: _Controls, texts: list[str]) -> list[list[int]]:
        """Token ids of markups without marks, each as ``encode`` encodes its text; except a text in which the
        normalizer makes a control token out of other characters (a case-folding or NFKC normalizer turns a
        message's "<|IM_END|>" into "<|im_end|>", matched as the token when it is ``normalized: true``, and
        ``protect``, looking for the spelling, left it unmarked): that one is encoded by a copy of the backend
        that matches control tokens only as spelled."""
        if controls.folded is None:
            data = json.loads(self._backend.to_str())
            folded = [t for t in data.get("added_tokens") or []
                      if t.get("content") in controls.ids and t.get("normalized")]
            for token in folded:
                token["normalized"] = False
            controls.folded = ((_RustTokenizer.from_str(json.dumps(data)), [t["content"] for t in folded])
                               if folded and self._backend.normalizer is not None else (self._backend, []))
        as_spelled, spellings = controls.folded
        if not spellings:
            return _encode_texts(self._backend, texts)
        normalize = self._backend.normalizer.normalize_str
        variant = [any(normalize(t).count(s) > t.count(s) for s in spellings) for t in texts]
        out = iter(_encode_texts(self._backend, [t for t, v in zip(texts, variant) if not v]))
        folded_out = iter(_encode_texts(as_spelled, [t for t, v in zip(texts, variant) if v]))
        return [next(folded_out) if v else next(out) for v in variant]

    @property
    def sha256(self) -> str:
        """Hex digest of the canonical tokenizer.json text; data shards record it to catch mix-ups."""
        return hashlib.sha256(self._canonical.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no bos/eos is added. Text that spells an added token (special or not) is that
        token, except in a ``ChatText`` (``apply_chat_template``), where of the control tokens
        (``special_spellings``) only the template's markers are."""
        if isinstance(text, ChatText):
            return self.encode_markup_batch([text.markup])[0]
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            check_text(text)
            raise

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel on the Rust side."""
        if any(isinstance(t, ChatText) for t in texts):  # each by its own kind: a plain text is not markup
            return [self.encode(t) for t in texts]
        return _encode_texts(self._backend, texts)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Special tokens are kept by default so that decode inverts encode exactly."""
        if hasattr(ids, "tolist"):  # numpy arrays and torch tensors
            ids = ids.tolist()
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text). A byte-level token may be part
        of a UTF-8 character, which ``decode`` of that token alone cannot show."""
        if self._bytes is None:
            self._bytes = _token_bytes_table(self._backend)
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def text_bytes(self, ids: np.ndarray) -> int:
        """UTF-8 bytes of the text ``ids`` stand for, special tokens (a document's end) standing for none: the
        denominator of bits per byte for exactly the tokens scored."""
        if self._text_lengths is None:
            if self._bytes is None:
                self._bytes = _token_bytes_table(self._backend)
            lengths = np.array([len(b) for b in self._bytes], dtype=np.int64)
            special = [i for i, t in self._backend.get_added_tokens_decoder().items() if t.special]
            lengths[[i for i in special if i < len(lengths)]] = 0
            self._text_lengths = lengths
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self._text_lengths)):
            bad = int(ids.max() if ids.max() >= len(self._text_lengths) else ids.min())
            raise LMForgeError(f"token id {bad} is outside this tokenizer's {len(self._text_lengths)} tokens: the data "
                               "was made with another tokenizer")
        return int(self._text_lengths[ids].sum())

    def max_chars(self, n_tokens: int) -> int:
        """The most characters ``n_tokens`` tokens can stand for: a token stands for at most its longest byte
        string (so as many characters), and a normaliser's composition merges at most a few characters into
        one: 3x that bound. A longer text cannot fit (with lmforge's byte-level tokenizers and byte-fallback
        ones; a foreign tokenizer whose normaliser deletes characters could fit more), so callers refuse it
        before tokenizing: tokenizing megabytes takes seconds to minutes and gigabytes."""
        if self._longest is None:
            self._longest = max(1, max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1))
        return 3 * self._longest * n_tokens

    def apply_chat_template(self, messages: list[dict], tools: list | None = None,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of an OpenAI-style conversation (``lmforge.chat``), ready for ``encode``.

        It is a ``ChatText``: ``encode`` of it encodes what the messages and tools say as text (a user's
        "</s>" is the characters, not the token), the template's own markers as special tokens."""
        from lmforge.chat import unmark

        markup = self.chat_markup(messages, tools, add_generation_prompt)
        return ChatText(unmark(markup, self.special_spellings), markup)

    def chat_markup(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the control-token spellings (``special_spellings``) of its messages and
        tools marked (``lmforge.chat.protect``): for ``encode_markup``, and for slicing at the rendered turns (SFT)."""
        from lmforge.chat import render_chat

        bos = self.special_tokens.get("bos") or ""
        return render_chat(messages, bos, self.special_tokens["eos"], tools=tools,
                           add_generation_prompt=add_generation_prompt, template=self.chat_template,
                           protect_specials=self.special_spellings)

    def encode_chat(self, messages: list[dict], tools: list | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a conversation (without the leading document separator the server adds)."""
        return self.encode_markup_batch([self.chat_markup(messages, tools, add_generation_prompt)])[0]

    def encode_markup_batch(self, markups: Sequence[str]) -> list[list[int]]:
        """Token ids of ``chat_markup`` texts (or pieces of them): each control-token spelling left in the
        markup (the template's) is that token; the text between, marks unmarked, is encoded with control-token
        spellings as plain text. A markup without marks (nothing the messages say spells a control token) is
        encoded as ``encode`` encodes its text, for every tokenizer (cutting at the markers and encoding the
        pieces alone would add a Metaspace tokenizer's leading "▁" after each marker)."""
        from lmforge.chat import MARK, unmark

        controls = self._control_tokens()
        if controls.pattern is None or not any(MARK in m for m in markups):
            return self._encode_unmarked(controls, [unmark(m, controls.spellings) for m in markups])
        if not all(MARK in m for m in markups):  # one way per markup, whatever the others in the batch are:
            marked = [MARK in m for m in markups]  # each way in one batch call
            ways = {True: iter(self.encode_markup_batch([m for m, k in zip(markups, marked) if k])),
                    False: iter(self.encode_markup_batch([m for m, k in zip(markups, marked) if not k]))}
            return [next(ways[k]) for k in marked]
        parts = [controls.pattern.split(m) for m in markups]  # text, control, text, control, ..., text
        first, rest = self._plain_backends(controls)
        starts = iter(_encode_texts(first, [unmark(ps[0], controls.spellings) for ps in parts]))
        afters = iter(_encode_texts(rest, [unmark(p, controls.spellings) for ps in parts for p in ps[2::2]]))
        out = []
        for ps in parts:
            ids: list[int] = []
            for k, p in enumerate(ps):
                ids += next(starts) if k == 0 else next(afters) if k % 2 == 0 else [controls.ids[p]]
            out.append(ids)
        return out

    def bytes_per_token(self, texts: Iterable[str]) -> float:
        """UTF-8 bytes per token over ``texts`` (higher = better compression)."""
        texts = list(texts)
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        n_tokens = sum(len(ids) for ids in self.encode_batch(texts))
        if n_tokens == 0:
            raise LMForgeError("bytes_per_token needs at least one non-empty text to measure.")
        return n_bytes / n_tokens

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        names = self.special_tokens
        special_map = {f"{role}_token": token for role, token in names.items() if token is not None}
        if self.is_native:
            special_map["additional_special_tokens"] = SPECIAL_TOKENS[4:]
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_map,
            "add_bos_token": False,
            "add_eos_token": False,
            # transformers must not touch spaces when decoding, or round trips break.
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
            "chat_template": self.chat_template,
        }
        texts = {TOKENIZER_FILE: self._backend.to_str(pretty=True),
                 CONFIG_FILE: json.dumps(config, indent=2) + "\n",
                 SPECIAL_MAP_FILE: json.dumps(special_map, indent=2) + "\n"}
        # All three are written to hidden files before any is renamed into place, so a failed write
        # (full disk) leaves the earlier set whole rather than a new tokenizer.json with old config files.
        with ExitStack() as stack:
            for name, text in texts.items():
                stack.enter_context(atomic_file(directory / name)).write_text(text, encoding="utf-8")
        return directory


def _read_by_template(template: str, candidates: set[str], bos: str, eos: str) -> set[str]:
    """Of ``candidates`` (added tokens ``template`` writes), those it reads in messages: rendered over a
    conversation whose every turn spells them (after a word, and first: ``in``, ``split`` and ``startswith``
    tests), protecting one changes the text it renders (it no longer finds it): alone, the others left visible
    (a test of two at once, ``'<think>' in c and '</think>' in c``), and then one at a time out of those still
    protected (a test of either). Tried with and without a system turn; a template that renders neither reads
    none."""
    from lmforge.chat import render_chat, unmark

    if not candidates:
        return set()
    contents = [" ".join(["x", *sorted(candidates), "y"]), "".join(sorted(candidates, reverse=True)) + " z"]
    turns = [{"role": role, "content": c} for c in contents for role in ("system", "user", "assistant")]
    # each (system, user, assistant) triple after the first without its system turn, then a final user turn
    full = turns + [{"role": "user", "content": contents[0]}]
    conversations = (full, [t for t in full if t["role"] != "system"])

    def render(protected: set[str], messages: list[dict]) -> str:
        marked = sorted(protected, key=len, reverse=True)
        return unmark(render_chat(messages, bos, eos, template=template, protect_specials=marked), marked)

    for messages in conversations:
        try:
            render(candidates, messages)
        except LMForgeError:
            continue

        def differs(a: set[str], b: set[str]) -> bool:
            try:
                return render(a, messages) != render(b, messages)
            except LMForgeError:
                return False  # (left protected: the safe side)

        read = {s for s in candidates if differs({s}, set())}
        protected = set(candidates) - read
        changed = True
        while changed:  # drop one that changes the render, until none does
            changed = False
            for s in sorted(protected):
                if differs(protected, protected - {s}):
                    protected.discard(s)
                    read.add(s)
                    changed = True
        return read
    return set()


def _metaspace_first_only(pre_tokenizer: dict | None) -> bool:
    """Whether ``pre_tokenizer`` (tokenizer.json's) is, or holds, a Metaspace with ``prepend_scheme: first``;
    if so, it is set to "never" in place (the pre-tokenizer of the text after a control token)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "Sequence":
        found = [_metaspace_first_only(p) for p in pre_tokenizer.get("pretokenizers") or []]
        return any(found)
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
        return True
    return False


def _encode_texts(backend: _RustTokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of ``texts`` (no bos/eos added), encoded in parallel on the Rust side; a text that is not a
    string is named."""
    try:
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    except TypeError:
        for text in texts:
            check_text(text)
        raise


@dataclass(eq=False)
class _Controls:
    """``Tokenizer.special_spellings`` for one chat template: the spellings (longest first), their ids, a pattern
    that splits a markup at them, and (built on first use) the backend copy that encodes them as text."""

    template: str
    spellings: list[str]
    ids: dict[str, int]
    pattern: re.Pattern | None
    plain: tuple[_RustTokenizer, _RustTokenizer] | None = None  # Tokenizer._plain_backends
    folded: tuple[_RustTokenizer, list[str]] | None = None  # Tokenizer._encode_unmarked


class ChatText(str):
    """A rendered conversation's text that remembers its ``chat_markup``: ``Tokenizer.encode`` of it encodes
    the messages' words as text and only the template's markers as special tokens. (Slices and sums of it
    are plain strings: encode those with ``encode_markup_batch`` on slices of the markup.)"""

    markup: str

    def __new__(cls, text: str = "", markup: str | None = None):
        self = super().__new__(cls, text)
        self.markup = text if markup is None else markup
        return self


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's stand-ins: each byte is written as one printable character in the vocabulary
    (printable Latin-1 bytes as themselves, the other 68 as the characters from U+0100 on, in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(moved)}}


METASPACE = "\u2581"  # "▁": SentencePiece's mark for a space (Llama-2, Mistral, T5 tokenizers)


def _token_bytes_table(backend: _RustTokenizer) -> list[bytes]:
    """Every token's bytes: a byte-level vocabulary's strings mapped back through its alphabet; a SentencePiece
    vocabulary's pieces with "▁" as the space it stands for (decoded alone, its decoder drops a leading one);
    another tokenizer's tokens decoded one by one (a byte-fallback token ``<0xE2>`` is that byte)."""
    size = backend.get_vocab_size(with_added_tokens=True)
    byte_level = isinstance(backend.decoder, decoders.ByteLevel)
    metaspace = METASPACE in json.dumps(json.loads(backend.to_str()).get("decoder"), ensure_ascii=False)
    alphabet = _byte_level_alphabet()
    specials = {t.content for t in backend.get_added_tokens_decoder().values()}
    table = []
    for i in range(size):
        piece = backend.id_to_token(i)
        if piece is None:
            table.append(b"")
        elif piece in specials:
            table.append(piece.encode("utf-8"))
        elif byte_level and all(c in alphabet for c in piece):
            table.append(bytes(alphabet[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table.append(bytes([int(piece[3:5], 16)]))
        elif metaspace:
            table.append(piece.replace(METASPACE, " ").encode("utf-8"))
        else:
            table.append(backend.decode([i], skip_special_tokens=False).encode("utf-8"))
    return table


def _configured_specials(directory: Path) -> dict[str, str | None] | None:
    """Special-token names from a HF tokenizer directory's config files, if it has any."""
    found: dict[str, str | None] = {}
    for name in (SPECIAL_MAP_FILE, CONFIG_FILE):  # the config file wins where both name a token
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LMForgeError(f"{path} is not valid JSON ({e}); fix or delete it") from e
        for role in COMMON_SPECIALS:
            value = data.get(f"{role}_token") if isinstance(data, dict) else None
            if isinstance(value, dict):  # {"content": "</s>", "lstrip": false, ...}
                value = value.get("content")
            if isinstance(value, str):
                found[role] = value
    if not found or all(found.get(r) == t for r, t in (("unk", UNK), ("bos", BOS), ("eos", EOS), ("pad", PAD))
                        if r in found):
        return None  # lmforge's own layout (or nothing named): decided from the vocabulary
    return found


def _configured_chat_template(directory: Path) -> str | None:
    """The ``chat_template`` string of a tokenizer_config.json beside the tokenizer, if any."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # _configured_specials has already reported a broken file
    template = data.get("chat_template") if isinstance(data, dict) else None
    return template if isinstance(template, str) and template else None


def require_same_tokenizer(given: str | Path, theirs: str | Path, init_from: str) -> None:
    """Fine-tuning with another tokenizer than the weights were trained with is refused: every id would
    mean another token."""
    if Tokenizer.load(given).sha256 != Tokenizer.load(theirs).sha256:
        raise LMForgeError(f"data.tokenizer={given} is not the tokenizer the weights of training.init_from={init_from} "
                           f"were trained with ({theirs}); leave data.tokenizer empty to use theirs")


def unused_vocab(model_vocab: int, tokenizer_vocab: int) -> int:
    """How many of a model's vocabulary rows its tokenizer never produces, when that is more than rounding
    the size up for the matmuls explains (GPT-2's 50257 to 50304, 8000 to 8192); else 0. A large gap
    usually means the tokenizer is not the one the weights were trained with."""
    gap = model_vocab - tokenizer_vocab
    return gap if gap > max(128, model_vocab // 10) else 0


def _untrained_bpe() -> _RustTokenizer:
    backend = _RustTokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _restore_advice(file: Path) -> str:
    """What to do about a damaged tokenizer.json: copy the same tokenizer back from another copy of it. A newly
    trained one has other ids, which weights or token shards made with the old one would silently mismatch."""
    here = file.parent
    if (here / "config.yaml").is_file() or (here / "meta.json").is_file():  # a checkpoint or a data directory
        run = here.parent.parent if here.parent.name == "checkpoints" else None
        copies = ([f"{run / 'tokenizer' / TOKENIZER_FILE}"] if run else []) + [
            "the data directory the run was trained on" if run else "the run's RUN_DIR/tokenizer/",
            "another checkpoint of the run" if run else "a checkpoint of a run trained on it"]
        return (f"Copy the same tokenizer over it from {', '.join(copies[:-1])} or {copies[-1]}; do not train a new "
                "one: its ids would not match the weights and data made with this one.")
    if here.name == "tokenizer" and (here.parent / "checkpoints").is_dir():  # a run's own copy
        return (f"Copy the same tokenizer over it from a checkpoint of the run ({here.parent / 'checkpoints'}/*/) "
                "or the data directory it was trained on; do not train a new one: its ids would not match the "
                "weights.")
    return ("Copy it back from where it came from (a run's RUN_DIR/tokenizer/, a data directory or a checkpoint "
            "made with it); re-create it with `lmforge tokenizer train` only if no model or prepared data uses it "
            "(a new tokenizer has other ids).")


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse to write over a file, or over an existing tokenizer unless asked (data shards made with it
    would no longer match)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise LMForgeError(f"--out {out_dir} is a file; give a directory for the tokenizer files")
    if (out_dir / TOKENIZER_FILE).exists() and not overwrite:
        raise LMForgeError(f"{out_dir / TOKENIZER_FILE} already exists; pass --overwrite to replace it (data "
                           "prepared with the old tokenizer will then refuse to train) or choose another --out")


# The BPE trainer's time grows with the square of a word's length: a document holding a 1 MB run of letters (a data
# blob, a minified file) took hours. The trainer is given such runs cut into pieces of at most this many characters
# (a cut is a word boundary for the trainer only; encoding is unchanged). No word of real text is this long.
LONGEST_TRAINING_WORD = 256
# (?<!...): a run is tried only from its first character, so text of long-but-allowed words is scanned once
_LONG_RUN = re.compile(r"(?<!\S)\S{%d,}|(?<!\s)\s{%d,}" % (LONGEST_TRAINING_WORD + 1, LONGEST_TRAINING_WORD + 1))


def _training_pieces(text: str) -> Iterator[str]:
    """``text`` for the BPE trainer: whole, or cut inside its runs longer than ``LONGEST_TRAINING_WORD``."""
    start = 0
    for run in _LONG_RUN.finditer(text):
        for cut in range(run.start() + LONGEST_TRAINING_WORD, run.end(), LONGEST_TRAINING_WORD):
            yield text[start:cut]
            start = cut
    yield text[start:]


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, min_frequency: int = 2,
                    show_progress: bool = True, overwrite: bool = False) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and save it in ``out_dir``.

    Returns the path of the written ``tokenizer.json``. ``vocab_size`` counts the 256 byte tokens and
    the special tokens; training stops early when no pair reaches ``min_frequency``.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise LMForgeError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs 256 byte tokens plus "
            f"{len(SPECIAL_TOKENS)} special tokens. Use --vocab-size {MIN_VOCAB_SIZE} or more "
            "(8192 is typical).")
    if min_frequency < 1:
        raise LMForgeError(f"min_frequency={min_frequency} must be at least 1.")
    check_out_dir(Path(out_dir), overwrite)
    non_empty = (t for t in texts if t)
    first = next(non_empty, None)
    if first is None:
        raise LMForgeError(
            "the tokenizer training corpus is empty: no non-empty text was found. Check the input "
            "paths and --include globs (or --text-field for record files).")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    backend = _untrained_bpe()
    pieces = (piece for text in itertools.chain([first], non_empty) for piece in _training_pieces(text))
    backend.train_from_iterator(pieces, trainer=trainer)
    with reporting_write_faults(Path(out_dir)):
        return Tokenizer(backend).save(out_dir) / TOKENIZER_FILE


def check_text(text: object) -> None:
    """The error for a text the Rust tokenizer refused: one holding an unpaired surrogate, which is what Python
    makes of bytes that are not UTF-8 in a command-line argument or terminal input (``surrogateescape``)."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"{ascii(bad)}"
        raise LMForgeError(f"the text holds {byte} at position {e.start}, which is not UTF-8 text (a command-line "
                           "argument or terminal input in another encoding?); use a UTF-8 locale, or give the text "
                           "in a UTF-8 file (e.g. --prompt-file)") from None

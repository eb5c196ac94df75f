"""What the post-training kinds (sft, reward, dpo, ppo, grpo) share, below them and above the core.

- ``formats``: conversations in the layouts people publish (OpenAI messages, prompt/completion,
  ShareGPT/Hermes, Glaive, xLAM) from JSONL, JSON, parquet or ``datasets`` directories.
- ``render``: a conversation rendered with the tokenizer's own chat template into ids and the mask
  of the tokens a model learns (the assistant's replies and their closing eos).
- ``packing``: rendered examples packed into rows without attention between them.
- ``toolcalls``: the generated tool-calling task, and scoring replies through the server's parser.
- ``preferences``: preference pairs (prompt, chosen, rejected) in the layouts people publish, and a
  generated set built from the tool-calling task.
- ``pairs``: preference pairs rendered and packed, both sides of a pair in one row.
- ``logprobs``: per-token log-probabilities of given tokens (what DPO, PPO and GRPO compare).
"""

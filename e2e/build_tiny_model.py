"""Build the e2e tier's small Llama model, deterministically and without downloads.

Usage: ``.venv-vllm/bin/python e2e/build_tiny_model.py OUT_DIR [LAYERS]``
(``make tiny-model`` runs it once into ``.cache/tiny-model``, and with 2 layers into
``.cache/tiny-model-2l``: a second model of another size, for two models on one
card; it needs ``tokenizers``, ``transformers`` and
``torch``, which live in ``.venv-vllm``, never in the proxy's venv).

What comes out (``shared/notes/vllm-cpu.md`` has the reasons):

- a byte-level BPE tokenizer of ``VOCAB_SIZE`` tokens, trained on the topic texts that
  ship with Python (``pydoc_data.topics``), saved through
  ``transformers.PreTrainedTokenizerFast`` with a plain chat template;
- a ``LlamaConfig`` model (hidden 512, 4 layers, 8 heads, 4 KV heads, intermediate
  1536, 8,192 positions), random weights from ``SEED``, bfloat16, ~15M parameters.

Its answers are gibberish; its timing is real vLLM timing. The model declares no
end-of-sequence token, so an answer always runs to ``max_tokens`` (or the context's
end), as in the simulated engine: random weights would otherwise sample an end
token about once in 2,000 tokens, and tests and comparisons need fixed lengths.

The same inputs give the same files, byte for byte: the training text is read in a
fixed order, BPE training breaks ties by pair, and the weights come from a seeded
generator. The script prints a digest of the files it wrote.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

SEED = 20261129
VOCAB_SIZE = 2048
MAX_POSITIONS = 8192
BOS = "<|bos|>"
PAD = "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Each message as "<|role|>\ncontent<|end|>\n"; the answer opens with "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def training_text() -> list[str]:
    """Python's own documentation topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def build_tokenizer(out: Path) -> int:
    """Train and save the tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # A plain prompt starts with BOS, as Llama's do; chat templates write their own.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)
    return len(fast)


def build_model(out: Path, vocab_size: int, layers: int = 4) -> int:
    """Save the random-weight model; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1536,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def digest(out: Path) -> str:
    """SHA-256 over the names and bytes of every file in ``out``."""
    h = hashlib.sha256()
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        h.update(path.relative_to(out).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or (len(argv) == 2 and not argv[1].isdigit()):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    params = build_model(out, vocab, int(argv[1]) if len(argv) == 2 else 4)
    print(f"{out}: vocab {vocab}, {params / 1e6:.1f}M parameters, sha256 {digest(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

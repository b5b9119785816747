"""The tokenizer a GGUF file describes, built with the `tokenizers` library from the header's metadata.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``), the merges, each
token's type, the special token ids, the pre-tokenizer's name (``tokenizer.ggml.pre``) and the chat template
under llama.cpp's keys. Byte-level BPE (``tokenizer.ggml.model = "gpt2"``) is built here: a `tokenizers` BPE
model over the vocabulary and merges, the pre-tokenizer llama.cpp names (`PRE_TOKENIZERS`: its splitting rules,
e.g. ``smollm`` isolates every digit before GPT-2's regex), the byte-level decoder, and the tokens typed
*control* as special tokens (``<|im_start|>``, ``<|im_end|>``: matched whole in a prompt, skipped when
decoding). transformers builds the same tokenizer from a GGUF file (``AutoTokenizer.from_pretrained(...,
gguf_file=...)``) through Python-side vocabularies, in about 14 s for SmolLM2's 49,152 tokens here; this takes a
fraction of a second, and the tests compare the two.

Refused, naming the metadata key: another tokenizer model (SentencePiece files need scores and byte fallback),
a pre-tokenizer not in `PRE_TOKENIZERS`, a vocabulary with duplicate or non-text tokens, a merge that is not two
tokens or names a token (or makes one) the vocabulary lacks, token types that are not integers, special token
ids outside the vocabulary, a beginning-of-sequence token that cannot be prepended as one piece, a
vocabulary larger than the model's (its embedding rows, which the header states) or with more than
`MAX_SPECIAL_TOKENS` special tokens — all before the tokenizer is built.
"""

from __future__ import annotations

import re

from executor.checkpoint_files import CheckpointError
from executor.gguf_file import GGUFHeader
from executor.tokenizer import CheckpointTokenizer
from kvstate.untrusted import Fields, shown

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types of special tokens and of added plain tokens
MAX_SPECIAL_TOKENS = 1 << 14  # control and user-defined tokens (a few hundred in public models)
EMBEDDING = "token_embd.weight"  # the tensor whose rows are the model's vocabulary
# A token that `tokenizers`' TemplateProcessing takes as one special-token piece: no whitespace (pieces are split
# on it), no colon (it introduces a type id), not starting with $ (a sequence: $A, $B, $0...).
_TEMPLATE_TOKEN = re.compile(r"[^\s:$][^\s:]*")
# End-of-generation ids: the end of sequence, and the end of a turn where the file names one.
STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _byte_level():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex, then bytes


def _digits_then_byte_level():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# llama.cpp's pre-tokenizer names (its `llama_vocab_pre_type`) that split as GPT-2 does, and how to build each.
PRE_TOKENIZERS = {"default": _byte_level, "gpt2": _byte_level, "smollm": _digits_then_byte_level}


def gguf_tokenizer(header: GGUFHeader) -> CheckpointTokenizer:
    """The tokenizer of `header`'s metadata (module docstring), with its stop ids and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    meta = Fields.of(header.metadata, "the GGUF metadata", path=header.path, error=CheckpointError)
    kind = meta.string("tokenizer.ggml.model")
    if kind != "gpt2":
        raise meta.fail(
            "tokenizer.ggml.model", f"is {shown(kind)}; only byte-level BPE tokenizers ('gpt2') are built here"
        )
    pre = meta.string("tokenizer.ggml.pre", default="default")
    if pre not in PRE_TOKENIZERS:
        raise meta.fail(
            "tokenizer.ggml.pre", f"is {shown(pre)}; the pre-tokenizers built here: {sorted(PRE_TOKENIZERS)}"
        )
    tokens = _strings(meta, "tokenizer.ggml.tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise meta.fail("tokenizer.ggml.tokens", "holds a token twice; a BPE vocabulary has each token once")
    merges = []
    for i, merge in enumerate(_strings(meta, "tokenizer.ggml.merges")):
        parts = tuple(merge.split(" "))
        if len(parts) != 2 or not all(parts):
            raise meta.fail(f"tokenizer.ggml.merges[{i}]", f"is {shown(merge)}, not two tokens joined by a space")
        missing = next((t for t in (*parts, "".join(parts)) if t not in vocab), None)
        if missing is not None:
            raise meta.fail(
                f"tokenizer.ggml.merges[{i}]",
                f"is {shown(merge)}: {shown(missing)} is not in the vocabulary (tokenizer.ggml.tokens); a merge "
                "joins two tokens of it into a third",
            )
        merges.append(parts)
    types = meta.get("tokenizer.ggml.token_type", [])
    if not isinstance(types, list) or len(types) not in (0, len(tokens)):
        raise meta.fail("tokenizer.ggml.token_type", f"must be one type per token, got {shown(types)}")
    _check_vocabulary(header, meta, tokens, types)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=False) if k == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED]
    )

    def token_id(key: str) -> int | None:
        return None if key not in meta.data else meta.integer(key, minimum=0, maximum=len(tokens) - 1)

    bos = token_id("tokenizer.ggml.bos_token_id")
    if meta.boolean("tokenizer.ggml.add_bos_token", default=False) and bos is not None:
        if not _TEMPLATE_TOKEN.fullmatch(tokens[bos]):
            raise meta.fail(
                "tokenizer.ggml.bos_token_id",
                f"names token {shown(tokens[bos])}, which cannot be prepended as a special token (it holds a "
                "space or a colon, or starts with $); a beginning-of-sequence token is one plain word",
            )
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    stops = tuple(dict.fromkeys(i for i in map(token_id, STOP_KEYS) if i is not None))
    template = meta.get("tokenizer.chat_template", None)
    if template is not None and not isinstance(template, str):
        raise meta.fail("tokenizer.chat_template", f"must be text, got {shown(template)}")
    return CheckpointTokenizer(
        tokenizer,
        stops,
        header.path,
        chat_template=template,
        bos_token="" if bos is None else tokens[bos],
        eos_token=tokens[stops[0]] if stops else "",
    )


def _check_vocabulary(header: GGUFHeader, meta: Fields, tokens: list[str], types: list) -> None:
    """Refuse, before anything is built, token types that are not integers, a vocabulary the model cannot embed
    or too many special tokens."""
    wrong = next((i for i, kind in enumerate(types) if isinstance(kind, bool) or not isinstance(kind, int)), None)
    if wrong is not None:
        raise meta.fail(f"tokenizer.ggml.token_type[{wrong}]", f"is {shown(types[wrong])}; a token type is an integer")
    embedding = header.tensor(EMBEDDING)
    if embedding is not None and len(tokens) > embedding.shape[0]:
        raise meta.fail(
            "tokenizer.ggml.tokens",
            f"holds {len(tokens)} tokens but the model embeds {embedding.shape[0]} ({EMBEDDING}); pair the "
            "checkpoint with the tokenizer it was trained with",
        )
    special = sum(1 for kind in types if kind in (CONTROL, USER_DEFINED))
    if special > MAX_SPECIAL_TOKENS:
        raise meta.fail(
            "tokenizer.ggml.token_type",
            f"marks {special} tokens as control or user-defined, more than the {MAX_SPECIAL_TOKENS} read here",
        )


def _strings(meta: Fields, key: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise meta.fail(key, "must be a non-empty list of non-empty strings")
    return value

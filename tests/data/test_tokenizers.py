import base64
import json
import random

import numpy as np
import pytest
import regex

from megatron_lite.config import ConfigError
from megatron_lite.tokenizer import build_tokenizer
from megatron_lite.tokenizer.bpe_trainer import save_gpt2_bpe_files, train_byte_level_bpe
from megatron_lite.tokenizer.gpt2_bpe import (EOD_TOKEN, PRETOKENIZE_PATTERN, bpe_merge, bytes_to_unicode,
                                             merge_pair, pretokenize)
from tests.data.conftest import TRICKY_TEXT

tokenizers = pytest.importorskip("tokenizers")


def hf_byte_level_bpe(vocab_file, merge_file):
    """The reference: Hugging Face's ByteLevel BPE on the same files, without a prefix space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_bytes_to_unicode_is_the_gpt2_map():
    mapping = bytes_to_unicode()
    assert sorted(mapping) == list(range(256)) and len(set(mapping.values())) == 256
    for b in [*range(33, 127), *range(161, 173), *range(174, 256)]:
        assert mapping[b] == chr(b)
    others = [b for b in range(256) if mapping[b] != chr(b)]
    assert [mapping[b] for b in others] == [chr(256 + n) for n in range(len(others))]
    assert mapping[ord(" ")] == "Ġ" and mapping[ord("\n")] == "Ċ"


def test_pretokenization_pattern():
    assert PRETOKENIZE_PATTERN.findall("I'm 12 dogs!!  so\n\n x") == \
        ["I", "'m", " 12", " dogs", "!!", " ", " so", "\n\n", " x"]
    assert PRETOKENIZE_PATTERN.findall("héllo wörld's") == ["héllo", " wörld", "'s"]


def test_ascii_text_is_split_as_the_unicode_pattern_splits_it():
    """pretokenize's `re` pattern for ASCII text against `regex`'s, on every ASCII character: runs of each
    class, contractions, whitespace runs before words and at the end."""
    rng = random.Random(0)
    pieces = [chr(c) for c in range(128)] + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "  ", " \t\n", "\r\n",
                                             "42", "word", " x", "!?"]
    texts = ["".join(rng.choices(pieces, k=rng.randint(0, 40))) for _ in range(3000)]
    for text in texts + ["I'm 12 dogs!!  so\n\n x", "tail  ", "\x1c\x1f\x7f"]:
        assert pretokenize(text) == PRETOKENIZE_PATTERN.findall(text), repr(text)
    assert pretokenize("héllo wörld's") == ["héllo", " wörld", "'s"]


def reference_bpe_merge(symbols, ranks):
    """BPE by its definition: merge all occurrences of the lowest-ranked adjacent pair (the leftmost of equal
    ranks) until no pair is ranked."""
    while len(symbols) > 1:
        best = min(zip(symbols, symbols[1:]), key=lambda pair: ranks.get(pair, float("inf")))
        if best not in ranks:
            return symbols
        symbols = merge_pair(symbols, *best)
    return symbols


def test_bpe_merge_applies_lowest_rank_first_and_all_occurrences():
    ranks = {("b", "c"): 0, ("a", "bc"): 1, ("a", "b"): 2}
    assert bpe_merge(list("abc"), ranks) == ["abc"]  # (b, c) outranks (a, b)
    assert bpe_merge(list("aaaa"), {("a", "a"): 0}) == ["aa", "aa"]
    assert bpe_merge(list("aaa"), {("a", "a"): 0}) == ["aa", "a"]  # left to right, no overlap
    assert bpe_merge(list("xyz"), ranks) == ["x", "y", "z"]
    # bpe_merge keeps the ranks of the pairs beside the symbols; the definition looks them all up at every step.
    rng = random.Random(0)
    for _ in range(300):
        alphabet = "abc"[:rng.randint(1, 3)]
        pairs = {(a, b) for a in alphabet for b in alphabet}
        pairs |= {(a + b, c) for a, b in pairs for c in alphabet} | {(c, a + b) for a, b in pairs for c in alphabet}
        ranks = {pair: rng.randrange(len(pairs)) for pair in rng.sample(sorted(pairs), rng.randint(1, len(pairs)))}
        symbols = rng.choices(alphabet, k=rng.randint(0, 12))
        assert bpe_merge(symbols, ranks) == reference_bpe_merge(symbols, ranks), (symbols, ranks)


def test_trainer_merges_the_most_frequent_pair_first_and_lays_out_the_vocab():
    vocab, merges = train_byte_level_bpe(["low low low lower newest newest"], 256 + 4 + 1)
    # ("l", "o") and ("o", "w") both occur 4 times (low, 2x " low", " lower"); ties go to the smaller pair.
    assert merges[0] == ("l", "o") and merges[1] == ("lo", "w")
    assert len(merges) == 4 and len(vocab) == 261
    byte_encoder = bytes_to_unicode()
    assert all(vocab[byte_encoder[b]] == b for b in range(256))
    assert [vocab[a + b] for a, b in merges] == [256, 257, 258, 259]
    assert vocab[EOD_TOKEN] == 260
    assert train_byte_level_bpe(["low low low lower newest newest"], 261) == (vocab, merges)  # deterministic


def test_gpt2_bpe_round_trips_real_text(bpe_files, demo_texts):
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])
    assert tokenizer.vocab_size == 4096 and tokenizer.eod == 4095 and tokenizer.pad == tokenizer.eod
    for text in [TRICKY_TEXT, "", " ", "\n", "  \n\t ", "".join(demo_texts[:50])]:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    ids = tokenizer.tokenize("".join(demo_texts))
    assert len(ids) < 0.3 * len("".join(demo_texts))  # the merges compress English about 4x


def test_gpt2_bpe_matches_huggingface_ids(bpe_files, demo_texts):
    """Same vocab.json/merges.txt, same ids, over the whole 460 KB corpus and tricky Unicode."""
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])
    reference = hf_byte_level_bpe(*bpe_files)
    texts = demo_texts + [TRICKY_TEXT]
    assert sum(len(t) for t in texts) > 400_000
    for ours_ids, reference_encoding in zip([ours.tokenize(t) for t in texts], reference.encode_batch(texts)):
        assert ours_ids == reference_encoding.ids


def test_gpt2_bpe_matches_huggingface_on_a_vocab_trained_by_huggingface(tmp_path, demo_texts):
    """Merges we did not learn ourselves, including Hugging Face's own tie-breaking."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(demo_texts, trainers.BpeTrainer(
        vocab_size=3000, special_tokens=[EOD_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf.model.save(str(tmp_path))
    vocab_file, merge_file = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    reference = hf_byte_level_bpe(vocab_file, merge_file)
    texts = demo_texts[::3] + [TRICKY_TEXT]
    assert [ours.tokenize(t) for t in texts] == [e.ids for e in reference.encode_batch(texts)]


def test_literal_endoftext_in_a_document_is_ordinary_pieces_not_eod(tmp_path, bpe_files):
    """As Megatron-LM's legacy GPT-2 tokenizer: only --append-eod adds EOD. Hugging Face tokenizers
    that register <|endoftext|> as special (transformers' GPT2TokenizerFast, a tokenizer.json) map it to EOD."""
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])
    text = f"first document{EOD_TOKEN}second"
    ids = ours.tokenize(text)
    assert ours.eod not in ids and ours.detokenize(ids) == text
    assert ids == hf_byte_level_bpe(*bpe_files).encode(text).ids  # byte-level BPE with no special tokens
    assert "".join(ours.decoder[i] for i in ids[len(ours.tokenize("first document")):]).startswith("<|")

    as_eod = ours.tokenize("first document") + [ours.eod] + ours.tokenize("second")
    with_special = hf_byte_level_bpe(*bpe_files)
    with_special.add_special_tokens([EOD_TOKEN])
    with_special.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOD_TOKEN}))
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)).tokenize(text) == as_eod
    transformers = pytest.importorskip("transformers")
    assert transformers.GPT2TokenizerFast(*bpe_files)(text).input_ids == as_eod


def test_mismatched_vocab_and_merges_are_reported(tmp_path, bpe_files):
    original = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])
    first_merged = original.decoder[256]
    vocab = dict(original.encoder)
    del vocab[first_merged]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=bpe_files[1])
    with pytest.raises(ValueError, match="do not belong together"):
        tokenizer.tokenize(original.detokenize([256]))


def test_sentencepiece_round_trips_real_text(sentencepiece_model, demo_texts):
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert tokenizer.vocab_size == 2048 and tokenizer.eod == 2 and tokenizer.pad == 3
    for text in [TRICKY_TEXT, " leading space", "trailing  ", "\n", "".join(demo_texts[:50])]:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_huggingface_tokenizer_json(tmp_path, bpe_files, demo_texts):
    hf = hf_byte_level_bpe(*bpe_files)
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="no end-of-document token: name the tokenizer's eos_token"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))  # nothing names its eos_token
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": EOD_TOKEN}}))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))  # the directory works too
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])
    assert tokenizer.vocab_size == 4096 and tokenizer.eod == gpt2.eod
    text = demo_texts[3] + TRICKY_TEXT
    assert tokenizer.tokenize(text) == gpt2.tokenize(text)
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tokenizer.vocab_size == 101 and tokenizer.eod == 100
    assert tokenizer.tokenize("5 17  99\n0") == [5, 17, 99, 0]
    assert tokenizer.detokenize(np.array([5, 17])) == "5 17"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.tokenize("3 100")
    with pytest.raises(ValueError, match="space-separated integers"):
        tokenizer.tokenize("3 x")


def write_tiktoken_vocab(path, merged: list[bytes]) -> str:
    """Megatron-LM's TikTokenizer JSON: the 256 single bytes, then ``merged`` in rank order."""
    tokens = [bytes([b]) for b in range(256)] + merged
    entries = [{"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": token.decode("latin-1")}
               for rank, token in enumerate(tokens)]
    path.write_text(json.dumps(entries))
    return str(path)


def test_tiktokenizer_merges_as_gpt2_bpe_with_the_same_merges(tmp_path, bpe_files, demo_texts):
    """tiktoken's rank-ordered merging gives our GPT-2 BPE's tokens on text both patterns chunk alike."""
    pytest.importorskip("tiktoken")
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])
    to_bytes = {i: bytes(gpt2.byte_decoder[c] for c in token) for token, i in gpt2.encoder.items()}
    merged = [to_bytes[gpt2.encoder[a + b]] for a, b in sorted(gpt2.bpe_ranks, key=gpt2.bpe_ranks.get)]
    vocab = write_tiktoken_vocab(tmp_path / "tiktoken.json", merged)
    tiktok = build_tokenizer("TikTokenizer", tokenizer_model=vocab, vocab_size=1000 + 256 + len(merged),
                             tiktoken_pattern="v1")
    rank = {token: r for r, token in enumerate([bytes([b]) for b in range(256)] + merged)}
    words = regex.findall(r"\b[a-z]+\b", " ".join(demo_texts[:40]))
    text = " ".join(words)  # lowercase words and single spaces: GPT-2's and v1's chunks coincide
    assert tiktok.tokenize(text) == [1000 + rank[to_bytes[i]] for i in gpt2.tokenize(text)]
    assert tiktok.detokenize(tiktok.tokenize(TRICKY_TEXT)) == TRICKY_TEXT


def test_tiktokenizer_ids_patterns_and_specials(tmp_path):
    pytest.importorskip("tiktoken")
    vocab = write_tiktoken_vocab(tmp_path / "v.json", [b"ab", b"oW"])
    tokenizer = build_tokenizer("TikTokenizer", tokenizer_model=vocab, vocab_size=1258)
    assert tokenizer.vocab_size == 1258 and (tokenizer.eod, tokenizer.pad) == (2, 4)  # </s> and <pad>
    assert tokenizer.tokenize("a") == [1000 + ord("a")] and tokenizer.tokenize("ab") == [1256]
    assert tokenizer.tokenize("x</s>") == [1000 + ord("x"), 2]  # special text is the special token, as Megatron
    # v2 (the default) splits camel case, so the "oW" merge across the boundary never applies; v1 keeps one chunk.
    assert 1257 not in tokenizer.tokenize("HelloWorld")
    v1 = build_tokenizer("TikTokenizer", tokenizer_model=vocab, vocab_size=1258, tiktoken_pattern="v1")
    assert 1257 in v1.tokenize("HelloWorld")
    small = build_tokenizer("TikTokenizer", tokenizer_model=vocab, vocab_size=266, tiktoken_num_special_tokens=10)
    assert small.tokenize("ab") == [10 + ord("a"), 10 + ord("b")]  # the merges were cut off by --vocab-size
    with pytest.raises(ValueError, match="the 256 single bytes"):
        build_tokenizer("TikTokenizer", tokenizer_model=vocab, vocab_size=1100)
    with pytest.raises(ValueError, match=r"holds 258 tokens.*pass --vocab-size 1258"):
        build_tokenizer("TikTokenizer", tokenizer_model=vocab)  # Megatron's default of 131072


def test_build_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type must be one of"):
        build_tokenizer("GPT3Tokenizer")
    with pytest.raises(ConfigError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"), merge_file=None)
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    save_gpt2_bpe_files({"a": 0}, [], str(tmp_path))
    with pytest.raises(ValueError, match="endoftext"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                        merge_file=str(tmp_path / "merges.txt"))


def test_train_tokenizer_tool_reads_text_and_jsonl(tmp_path, demo_texts, load_tool, capsys):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in demo_texts[:60]) + "\n{bad\n",
                                      encoding="utf-8")
    (tmp_path / "b.txt").write_text(demo_texts[60], encoding="utf-8")
    inputs = ["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--vocab-size", "600"]
    tool = load_tool("train_tokenizer")
    assert tool.main([*inputs, "--tokenizer-type", "GPT2BPETokenizer", "--output-dir", str(tmp_path / "bpe")]) == 0
    assert tool.main([*inputs, "--tokenizer-type", "SentencePieceTokenizer", "--output-dir", str(tmp_path / "sp")]) == 0
    assert f"{tmp_path / 'a.jsonl'}:61: malformed JSON" in capsys.readouterr().err
    for tokenizer in [build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "bpe/vocab.json"),
                                      merge_file=str(tmp_path / "bpe/merges.txt")),
                      build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp/tokenizer.model"))]:
        assert tokenizer.vocab_size == 600
        assert tokenizer.detokenize(tokenizer.tokenize(TRICKY_TEXT)) == TRICKY_TEXT


def test_train_tokenizer_tool_mistakes_are_one_error_line(tmp_path, load_tool, capsys):
    """A first day's mistakes: a --vocab-size below the bytes, a wrong --json-keys (which trained a BPE on
    nothing), a vocabulary larger than the text allows. Each is one `error:` line naming the flag, no traceback."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of some text"}) + "\n" for i in range(50)))
    tool = load_tool("train_tokenizer")
    common = ["--input", str(corpus), "--output-dir", str(tmp_path / "out")]
    cases = [(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "100"], "--vocab-size 100 is below"),
             (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "300", "--json-keys", "txt"],
              "under --json-keys txt"),
             (["--tokenizer-type", "SentencePieceTokenizer", "--vocab-size", "300", "--json-keys", "txt"],
              "under --json-keys txt"),
             (["--tokenizer-type", "SentencePieceTokenizer", "--vocab-size", "100000"],
              "could not train a --vocab-size 100000 model: "),
             (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "300", "--json_keys", "text"],
              "unrecognized argument --json_keys (did you mean --json-keys?)")]  # not argparse's usage block
    for flags, message in cases:
        assert tool.main([*common, *flags]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "vocab.json").exists()


LLAMA3_TEMPLATE = ("{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
                   "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}")


@pytest.mark.parametrize("names_eos", [True, False], ids=["eos_token", "chat-template-end-of-turn"])
def test_huggingface_eod_is_the_tokenizers_own_eos_token(tmp_path, bpe_files, names_eos):
    """Llama 3 Instruct's eos_token is <|eot_id|>, which no fixed list of end-of-document tokens had (issue 43,
    item 7): the tokenizer's own eos_token is the EOD, else the token its chat template ends an answer with."""
    hf = hf_byte_level_bpe(*bpe_files)
    hf.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|eot_id|>"} if names_eos
                                                               else config))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    assert (tokenizer.eod, tokenizer.bos) == (hf.token_to_id("<|eot_id|>"), hf.token_to_id("<|begin_of_text|>"))
    assert tokenizer.eod != hf.token_to_id("<|end_of_text|>") and tokenizer.pad == tokenizer.eod  # no pad_token
    if names_eos:
        transformers = pytest.importorskip("transformers")
        assert transformers.AutoTokenizer.from_pretrained(str(tmp_path)).eos_token_id == tokenizer.eod
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
        with pytest.raises(ConfigError, match="names eos_token '<|im_end|>', which its tokenizer.json does not hold"):
            build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))

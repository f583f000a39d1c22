"""DataConfig: pretraining data and its tokenizer, or fine-tuning records (--sft, --dpo, --grpo)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.fields import check_choices, require


# --sft-tokenizer-prompt-format: how a conversation becomes text (megatron_lite/data/sft/prompt_format.py).
SFT_PROMPT_FORMATS = ("plain", "chatml", "default")
# --sft-format: the records' shape, and the names --sft-data-keys NAME=COLUMN may read a column under
# (megatron_lite/data/sft/formats.py).
SFT_FORMATS = ("auto", "prompt_response", "messages", "alpaca", "sharegpt")
SFT_DATA_KEY_NAMES = ("prompt", "response", "messages", "instruction", "input", "output", "system", "history",
                      "conversations")
# --tokenizer-type values (megatron_lite/tokenizer/ builds each).
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "TikTokenizer",
                   "NullTokenizer")


@dataclass(kw_only=True)
class DataConfig:
    data_path: list = field(default_factory=list)  # [path] or [w1, path1, w2, path2, ...]
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: Optional[str] = field(default=None, metadata={"choices": TOKENIZER_TYPES})
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    # v1 or v2 pre-tokenisation; only TikTokenizer reads it.
    tiktoken_pattern: Optional[str] = field(default=None, metadata={"choices": ("v1", "v2")})
    tiktoken_num_special_tokens: int = 1000
    data_cache_path: Optional[str] = None
    mmap_bin_files: bool = True  # --no-mmap-bin-files reads .bin with file reads (for filesystems mmap is slow on)
    eod_mask_loss: bool = False
    num_workers: int = 0  # data-loader worker processes per rank (Megatron's default is 2)
    # Supervised fine-tuning: prompt/response or chat JSONL files (or preprocessed prefixes), one list per split.
    sft: bool = False
    train_data_path: list = field(default_factory=list)
    valid_data_path: list = field(default_factory=list)
    test_data_path: list = field(default_factory=list)
    sft_tokenizer_prompt_format: str = field(default="plain", metadata={"choices": SFT_PROMPT_FORMATS})
    sft_pack_sequences: bool = False
    sft_format: str = field(default="auto", metadata={"choices": SFT_FORMATS})  # per record, from its keys
    sft_data_keys: list = field(default_factory=list)  # NAME=COLUMN: read COLUMN as NAME (see SFT_DATA_KEY_NAMES)
    # Preference pairs {"prompt", "chosen", "rejected"} in the fine-tuning files: fine-tuning data, so --sft too.
    dpo: bool = False
    # Prompts {"prompt"} or {"messages"} to sample completions of and reward (GRPOConfig): fine-tuning data too.
    grpo: bool = False

    def __post_init__(self) -> None:
        check_choices(self)
        require(not (self.dpo and self.grpo), "--dpo and --grpo are two ways to train: give one.")
        self.sft = self.sft or self.dpo or self.grpo
        # Megatron reads only the numbers in --split, so a launcher's literal quotes ('99,1,0', as
        # Megatron-LM's Llama 3 example passes them) are harmless there; strip them here too.
        self.split = self.split.strip("'\"")
        if self.sft:
            self._check_sft()
        else:
            require(not (self.train_data_path or self.valid_data_path or self.test_data_path),
                     "--train-data-path/--valid-data-path/--test-data-path name fine-tuning data: add --sft "
                     "(pretraining reads --data-path with --split).")
            require(not self.sft_pack_sequences, "--sft-pack-sequences needs --sft.")
            require(self.sft_format == "auto" and not self.sft_data_keys,
                     "--sft-format and --sft-data-keys say how to read fine-tuning data: add --sft.")
            require(self.mock_data or bool(self.data_path),
                     "no training data: give --data-path PREFIX (from tools/preprocess_data.py) or --mock-data.")
        require(not (self.mock_data and self.data_path),
                 "--mock-data and --data-path both given: drop --mock-data to train on the data, or --data-path.")
        require(self.tokenizer_type is not None or not (self.vocab_file or self.merge_file or self.tokenizer_model),
                 "--vocab-file/--merge-file/--tokenizer-model need --tokenizer-type to say how to read them "
                 "(GPT2BPETokenizer for GPT-2's vocab.json and merges.txt).")
        require(not self.eod_mask_loss or self.tokenizer_type is not None,
                 "--eod-mask-loss needs --tokenizer-type (and its files) to know the end-of-document token.")
        require(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}.")
        parts = self.split.replace("/", ",").split(",")
        require(all(p.strip().replace(".", "", 1).isdigit() for p in parts) and len(parts) <= 3,
                 f"--split must be up to three comma-separated weights like 969,30,1, got {self.split!r}.")

    def _check_sft(self) -> None:
        require(bool(self.train_data_path),
                 "--sft needs --train-data-path: JSONL of {\"prompt\", \"response\"} or {\"messages\"} lines, or a "
                 "prefix written by tools/preprocess_data.py --sft.")
        require(not (self.data_path or self.mock_data),
                 "--sft reads --train-data-path (and --valid-data-path, --test-data-path); "
                 "drop --data-path/--mock-data.")
        require(self.tokenizer_type is not None, "--sft needs --tokenizer-type (and its files): the data is text.")
        check_sft_data_keys(self.sft_data_keys)


def check_sft_data_keys(entries: list[str]) -> None:
    """--sft-data-keys NAME=COLUMN ...: each NAME one the record formats read; the tools with their own parser
    (evaluate, preprocess_data) check theirs here too."""
    for entry in entries:
        name, _, column = entry.partition("=")
        require(name in SFT_DATA_KEY_NAMES and bool(column),
                 f"--sft-data-keys takes NAME=COLUMN with NAME among {', '.join(SFT_DATA_KEY_NAMES)} "
                 f"(e.g. prompt=question), got {entry!r}.")

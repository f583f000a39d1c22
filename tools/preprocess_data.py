"""Tokenize a JSONL corpus into Megatron-LM indexed datasets.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2

writes data/corpus_text_document.bin/.idx; train with --data-path data/corpus_text_document.

    python tools/preprocess_data.py --sft --sft-tokenizer-prompt-format chatml --input sft.jsonl \
        --output-prefix data/sft --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer_dir

reads prompt/response, chat, Alpaca or ShareGPT records (JSONL, JSON array, Parquet, Arrow, or a
datasets.save_to_disk directory; see docs/coming_from_hf_and_deepspeed.md) and writes the ids
(data/sft_text_document) and their loss mask (data/sft_loss_mask_document); fine-tune with
--sft --train-data-path data/sft. With --dpo instead, TRL's preference records (prompt, chosen, rejected), each
pair one document of two sequences (chosen, rejected); train with --dpo --train-data-path data/pairs.
"""
import argparse
import sys

from megatron_lite.config import SFT_PROMPT_FORMATS, ConfigError, DataConfig
from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.data.indexed_dataset import output_prefix_for
from megatron_lite.data.preprocess import PreprocessError, preprocess_jsonl
from megatron_lite.data.sft import RecordFormat
from megatron_lite.data.sft.formats import add_record_format_arguments
from megatron_lite.config import TOKENIZER_TYPES


def parse_args(argv=None) -> argparse.Namespace:
    # One `error:` line naming the flag (and the nearest known one), not argparse's usage block.
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="JSONL file(s), one JSON object per line (--sft: also JSON, Parquet, Arrow files and "
                            "datasets.save_to_disk directories)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one output pair each")
    group.add_argument("--sft", action="store_true",
                       help='fine-tuning lines ({"prompt", "response"} or {"messages"}): write ids and loss mask')
    group.add_argument("--dpo", action="store_true",
                       help='preference pairs ({"prompt", "chosen", "rejected"}, as --dpo reads them): write ids and '
                            'loss mask, a pair per document (chosen, rejected)')
    group.add_argument("--sft-tokenizer-prompt-format", choices=SFT_PROMPT_FORMATS, default="plain",
                       help="how --sft and --dpo conversations become text (default: plain)")
    add_record_format_arguments(group)
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    group.add_argument("--tokenizer-model", help="SentencePiece .model, Hugging Face tokenizer.json or "
                                                 "TikTokenizer JSON vocabulary")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: ids are 0..vocab-size-1, EOD = vocab-size; "
                                                      "TikTokenizer: special plus BPE tokens (default 131072)")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"), help="TikTokenizer pre-tokenisation (default v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer special ids")
    group.add_argument("--append-eod", action="store_true",
                       help="end every non-empty document with the EOD token (an empty one stays empty, as in "
                            "Megatron-LM)")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    group.add_argument("--strict", action="store_true", help="abort on the first bad line instead of skipping it")
    args = parser.parse_args(argv)
    if args.sft or args.dpo:  # the training flags' own checks, so both name a bad --sft-data-keys alike
        DataConfig(sft=True, dpo=args.dpo, train_data_path=args.input, tokenizer_type=args.tokenizer_type,
                   sft_format=args.sft_format, sft_data_keys=args.sft_data_keys)
    if args.dpo and (args.sft or args.sft_format != "auto" or args.sft_data_keys):
        raise ConfigError("--dpo reads TRL's preference records (prompt, chosen, rejected): drop --sft, --sft-format "
                          "and --sft-data-keys.")
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tokenizer_kwargs = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                            merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                            vocab_size=args.vocab_size, tiktoken_pattern=args.tiktoken_pattern,
                            tiktoken_num_special_tokens=args.tiktoken_num_special_tokens)
    try:
        preprocess_jsonl(args.input, output_prefix=args.output_prefix, tokenizer_kwargs=tokenizer_kwargs,
                         json_keys=tuple(args.json_keys), append_eod=args.append_eod, workers=args.workers,
                         log_interval=args.log_interval, strict=args.strict,
                         sft_prompt_format=args.sft_tokenizer_prompt_format if args.sft or args.dpo else None,
                         sft_record_format=RecordFormat.from_flags(args.sft_format, args.sft_data_keys),
                         preference=args.dpo)
    except (PreprocessError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.sft or args.dpo:
        print(f"--{'dpo' if args.dpo else 'sft'} --train-data-path {args.output_prefix}")
        return 0
    for key in args.json_keys:
        print(f"--data-path {output_prefix_for(args.output_prefix, key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Supervised fine-tuning data: chat templates (``prompt_format``), the files and record shapes read
(``formats``), examples checked and tokenized from them or read from preprocessed indexed datasets
(``examples``), and padded or packed samples (``sft_dataset``)."""
from megatron_lite.data.sft.examples import SFTExamples, load_sft_examples, split_last_response
from megatron_lite.data.sft.formats import RecordFormat, SFTDataError, conversation_of
from megatron_lite.data.sft.prompt_format import format_prompt, response_text, tokenize_conversation
from megatron_lite.data.sft.sft_dataset import SFTDataset

__all__ = ["RecordFormat", "SFTDataError", "SFTDataset", "SFTExamples", "conversation_of", "format_prompt",
           "load_sft_examples", "response_text", "split_last_response", "tokenize_conversation"]

"""GPT: embedding -> transformer layers -> final norm -> output layer -> loss (and, with --mtp-num-layers, the
multi-token prediction layers' loss: multi_token_prediction.py).

One class covers GPT-2 and Llama (see ModelConfig). A pipeline stage is the same
class built with ``pre_process`` (holds the embedding), ``post_process`` (holds the
final norm, the output layer and the loss) and the global layer numbers it runs.
Under context parallelism (``context_parallel``) it runs on this rank's positions of each
sequence, its inputs, position ids and labels cut to them (``context_parallel/sharding.py``);
only attention looks across the ranks.
"""
import torch
from torch import nn

from megatron_lite.process_groups import collectives
from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig, local_positions
from megatron_lite.expert_parallel import ExpertParallelConfig
from megatron_lite.model.embedding import LanguageModelEmbedding, rotary_angles
from megatron_lite.model.moe.router import TopKRouter
from megatron_lite.model.moe.routing_pool import RoutingPool
from megatron_lite.model.multi_token_prediction import MultiTokenPredictionBlock
from megatron_lite.model.norm import Norm
from megatron_lite.model.soft_capping import soft_capping
from megatron_lite.model.transformer_block import TransformerBlock
from megatron_lite.tensor_parallel import (ColumnParallelLinear, TensorParallelConfig,
                                           gather_from_tensor_model_parallel_region)
from megatron_lite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_entropy


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, tp_config: TensorParallelConfig, *, layer_numbers: range | None = None,
                 context_parallel: ContextParallelConfig | None = None, pre_process: bool = True,
                 post_process: bool = True, recompute_granularity: str | None = None,
                 recompute_method: str | None = None, recompute_num_layers: int | None = None,
                 ep_config: ExpertParallelConfig = ExpertParallelConfig()):
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.sequence_parallel = tp_config.sequence_parallel
        self.tp_group = tp_config.tp_group
        self.context_parallel = context_parallel
        self.padded_vocab_size = config.padded_vocab_size(collectives.world_size(tp_config.tp_group))
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.input_tensor = None
        self.logit_capping = soft_capping(config.final_logit_softcapping)
        layer_numbers = range(config.num_layers) if layer_numbers is None else layer_numbers

        # Multi-token prediction's layers run on the last stage, which then holds a copy of the embedding too.
        has_mtp = post_process and config.mtp_num_layers is not None
        self.holds_embedding = pre_process or has_mtp
        if self.holds_embedding:
            self.embedding = LanguageModelEmbedding(config, padded_vocab_size=self.padded_vocab_size,
                                                    tp_config=tp_config)
        self.decoder = TransformerBlock(config, layer_numbers, context_parallel=context_parallel,
                                        recompute_granularity=recompute_granularity,
                                        recompute_method=recompute_method,
                                        recompute_num_layers=recompute_num_layers, tp_config=tp_config,
                                        ep_config=ep_config)
        if post_process:
            self.final_layernorm = Norm(config.hidden_size, normalization=config.normalization,
                                        eps=config.norm_epsilon, apply_layernorm_1p=config.apply_layernorm_1p,
                                        sequence_parallel=tp_config.sequence_parallel,
                                        params_dtype=tp_config.params_dtype)
            tied_here = self.share_embeddings_and_output_weights and self.holds_embedding
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, bias=False, gather_output=False,
                skip_weight_param_allocation=tied_here, tp_config=tp_config)
        self.mtp = (MultiTokenPredictionBlock(config, tp_config=tp_config, context_parallel=context_parallel,
                                              ep_config=ep_config) if has_mtp else None)
        if pre_process != post_process:
            # First and last stage each hold a copy of the tied embedding (and, for multi-token prediction, of the
            # whole embedding); their gradients are summed over the embedding group so the copies stay identical.
            if self.share_embeddings_and_output_weights:
                self.shared_embedding_or_output_weight().shared_embedding = True
            if config.mtp_num_layers is not None:
                for param in self.embedding.parameters():
                    param.shared_embedding = True
        # Megatron's mark for --decoupled-lr: these weights train on their own learning rate.
        if self.holds_embedding:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        # --moe-router-load-balancing-type pooled_aux_loss: each micro-batch's routing counts over all layers.
        self.pools_routing = (config.num_experts is not None and config.moe_aux_loss_coeff > 0
                              and config.moe_router_load_balancing_type == "pooled_aux_loss")
        self.routers = [m for m in self.decoder.modules() if isinstance(m, TopKRouter)]
        self.next_pool = None

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padding rows of the vocabulary are not tokens: keep them out of the softmax, which also
        makes the loss independent of how much padding the tensor-parallel size added."""
        local = logits.shape[-1]
        first = collectives.rank(self.tp_group) * local
        if first + local <= self.config.vocab_size:
            return logits
        padding = torch.arange(first, first + local, device=logits.device) >= self.config.vocab_size
        return logits.masked_fill(padding, float("-inf"))

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        if self.holds_embedding:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def _position_ids(self, input_ids: torch.Tensor, inference_context, device=None) -> torch.Tensor:
        """[b, s] positions of the tokens given (on ``device``, by default theirs): each token's column, 0, 1, ...,
        counting on after a generation's cached tokens; under context parallelism (training's, or a generation's
        split prefill), this rank's positions of the whole sequence."""
        device = input_ids.device if device is None else device
        cp = self.context_parallel
        if cp is None and inference_context is not None and inference_context.splits_sequence:
            cp = inference_context.context_parallel
        if cp is not None:
            positions = local_positions(input_ids.shape[1] * cp.size, cp.rank, cp.size).to(device)
            return positions.expand(input_ids.shape)
        first = inference_context.sequence_len_offset if inference_context is not None else 0
        return torch.arange(first, first + input_ids.shape[1], device=device).expand(input_ids.shape)

    def _positions_are_columns(self, position_ids: torch.Tensor, input_ids: torch.Tensor, inference_context) -> bool:
        """Whether the given positions are the ones the model makes (each token's column: no packed examples, no
        padding), which lets Llama 4's chunked layers fold their chunks (``chunked_attention.py``). Only a model
        with chunked layers asks; it reads them where they lie: on the host (the trainer's batch,
        ``training.loop.forward_step``) without touching the device, else once per forward."""
        if self.config.attention_chunk_size is None:
            return False
        return torch.equal(position_ids, self._position_ids(input_ids, inference_context, position_ids.device))

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """The pipeline schedule hands a non-first stage its input activations here."""
        self.input_tensor = input_tensor

    @property
    def microbatch_statistics_size(self) -> int:
        """The floats of statistics a micro-batch carries between pipeline stages (0: none): the pooled
        routing counts of ``pooled_aux_loss`` (``moe/routing_pool.py``)."""
        return self.config.num_experts if self.pools_routing else 0

    def begin_microbatch(self, received: torch.Tensor | None) -> RoutingPool:
        """The next forward's routing pool, continuing from the earlier stages' counts ``received``; the pipeline
        schedule completes it on the last stage and hands the total back before that micro-batch's backward."""
        moe_layers = sum(self.config.is_moe_layer(i) for i in range(self.config.num_layers))
        self.next_pool = RoutingPool(self.config.num_experts, moe_layers, received,
                                     device=next(self.parameters()).device)
        return self.next_pool

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                inference_context=None, loss_mask: torch.Tensor | None = None,
                temperature: float = 1.0, entropy: bool = False):
        """Returns per-token loss [b, s] given labels on the last stage, logits over the
        (unpadded) vocabulary [b, s, V] without them, and hidden states [s, b, h] on other stages.

        ``position_ids`` [b, s] (None: each token's column) may lie on the host, where Llama 4's model reads
        whether they are the columns without touching the device (``_positions_are_columns``).

        ``attention_mask`` (bool [b, 1, s, s], True = may not attend, Megatron's convention) replaces the
        causal mask; packed sequences pass their documents instead (``document_rows.PackedDocuments``), so
        examples cannot see each other. Every pipeline stage is given it, with the position ids.

        With an ``inference_context`` (generation, ``inference/text_generation.py``) the tokens follow the
        ones it has cached: positions count on from its offset, and only the last token's logits [b, 1, V]
        are computed, the only ones sampled from.

        With multi-token prediction layers (``multi_token_prediction.py``) and a ``loss_mask`` [b, s], a training
        forward adds their loss to the returned loss's gradient (the returned values are the language model's).

        ``temperature`` divides the logits before the loss: --grpo scores completions by the distribution they
        were sampled from (logits / temperature), as TRL's GRPOTrainer does; with ``entropy`` the last stage returns
        (per-token loss, per-token entropy [b, s] of that distribution, without a gradient), which --grpo logs."""
        if position_ids is None:
            position_ids, columns = self._position_ids(input_ids, inference_context), True
        else:
            columns = self._positions_are_columns(position_ids, input_ids, inference_context)
            position_ids = position_ids.to(input_ids.device, non_blocking=True)
        if self.mtp is not None:
            self.mtp.logged_losses = []  # a forward that runs no multi-token prediction logs none
        if self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids)
        else:
            hidden_states = self.input_tensor
        positions = position_ids.to(hidden_states.device)
        rotary = rotary_angles(positions, self.config) if self.config.rotary else None
        pool, self.next_pool = self.next_pool, None
        whole_model = (self.pools_routing and pool is None and self.pre_process and self.post_process
                       and self.training and torch.is_grad_enabled())
        if whole_model:  # run outside a schedule: its pool is complete after this forward
            pool = self.begin_microbatch(None)
            self.next_pool = None
        for router in self.routers:
            router.pool = pool
        hidden_states = self.decoder(hidden_states, rotary, attention_mask, positions, inference_context, columns)
        if whole_model:
            pool.complete()
        if not self.post_process:
            return hidden_states
        if inference_context is not None:
            hidden_states = hidden_states[-1:]
        hidden_states = self.final_layernorm(hidden_states)
        logits = self._logits(hidden_states)
        if labels is None:
            logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
            return logits[..., :self.config.vocab_size].transpose(0, 1).contiguous()
        if entropy:  # of the logits the loss reads (its forward leaves them as they are)
            scaled = self._scaled(logits, temperature)
            return self._loss_of(scaled, labels), vocab_parallel_entropy(scaled.detach(), self.tp_group).t()
        loss = self._cross_entropy(logits, labels, temperature)
        if self.mtp is not None and loss_mask is not None and self.training:
            depths = self.mtp(hidden_states, input_ids, position_ids, self.embedding, rotary, attention_mask, columns)
            loss = self.mtp.attach_loss(loss, lambda k, k_labels: self._cross_entropy(self._logits(depths[k - 1]),
                                                                                      k_labels),
                                        labels, loss_mask, position_ids)
        return loss

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, V/tp]: the output layer (the embedding when tied), soft-capped if the model caps."""
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=output_weight)
        return logits if self.logit_capping is None else self.logit_capping(logits)

    def _cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Per-token loss [b, s] of logits [s, b, V/tp] / ``temperature`` against labels [b, s]."""
        return self._loss_of(self._scaled(logits, temperature), labels)

    def _loss_of(self, scaled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss [b, s] of ``_scaled`` logits [s, b, V/tp] against labels [b, s]."""
        return vocab_parallel_cross_entropy(scaled, labels.t().contiguous(), self.tp_group).t().contiguous()

    def _scaled(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """fp32 logits / ``temperature``, the vocabulary's padding rows out of the softmax."""
        logits = logits.float() if temperature == 1.0 else logits.float() / temperature
        return self._mask_padding(logits)

"""A minimal GRPO learner: the reference training step of the demo, on verl-layout batches.

Policy gradient with group-relative advantages (no critic, no KL, one update per batch, so the
ratio is 1 and PPO clipping is a no-op): loss = -mean over policy tokens of advantage x log-prob.
"""

from __future__ import annotations

import torch

from client.batch import RolloutBatch


class GRPOLearner:
    def __init__(self, model_path: str, *, lr: float = 1e-3, max_grad_norm: float = 1.0, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        prompt_len = batch.prompts.shape[1]
        logits = self.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, prompt_len - 1 : -1]  # position t predicts response token t
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logp = logp_all.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
        mask = batch.response_mask.float()
        tokens = mask.sum().clamp(min=1.0)
        loss = -(batch.advantages[:, None] * logp * mask).sum() / tokens
        entropy = -((logp_all.exp() * logp_all).sum(-1) * mask).sum() / tokens
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return {"actor/pg_loss": loss.item(), "actor/grad_norm": float(grad_norm), "actor/entropy": entropy.item()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

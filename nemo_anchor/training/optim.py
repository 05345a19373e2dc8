"""AdamW with Megatron's parameter groups and a warmup + constant/cosine schedule."""
from __future__ import annotations

import math

import torch

from nemo_anchor.training.config import OptimConfig


def build_optimizer(params: list[torch.Tensor], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; like Megatron, norms and biases (1-D parameters) get no weight decay."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the per-tensor path is bitwise reproducible across resumes on the CPU
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def learning_rate(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup, then constant or cosine to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


class MixedPrecisionOptimizer:
    """AdamW on fp32 master weights for a model that computes in its own dtype, as Megatron does.

    In bf16 runs the model's parameters are bf16 (what the kernels compute with) and this keeps
    an fp32 master copy: each micro-batch's bf16 gradients are accumulated into fp32 master
    gradients, reduced, clipped and stepped in fp32, and the result is rounded back into the
    model. In fp32 runs the masters are the parameters themselves.
    """

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig):
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for _, p in self.named_params)
        self.masters = {n: torch.nn.Parameter(p.detach().float().clone()) if self.mixed else p
                        for n, p in self.named_params}
        self.optimizer = build_optimizer(list(self.masters.values()), cfg)

    def master_weights(self) -> dict[int, torch.Tensor]:
        """Model parameter ``data_ptr`` -> its fp32 master (checkpoints store fp32 weights)."""
        return {p.data_ptr(): self.masters[n].detach() for n, p in self.named_params}

    def accumulate_gradients(self) -> None:
        """Move the model's fresh gradients into the fp32 master gradients (after each backward)."""
        if not self.mixed:
            return
        for name, p in self.named_params:
            if p.grad is not None:
                master = self.masters[name]
                master.grad = p.grad.float() if master.grad is None else master.grad.add_(p.grad)
                p.grad = None

    def gradients(self) -> list[torch.Tensor]:
        return [m.grad for m in self.masters.values() if m.grad is not None]

    def step(self, lr: float, clip_grad: float) -> float:
        """Clip, step at ``lr``, copy masters back into the model; returns the pre-clip grad norm."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = torch.nn.utils.clip_grad_norm_(list(self.masters.values()), clip_grad or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                for name, p in self.named_params:
                    p.copy_(self.masters[name])
        return float(grad_norm)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Set masters and model parameters from full-precision ``{parameter name: tensor}``."""
        with torch.no_grad():
            for name, p in self.named_params:
                self.masters[name].copy_(weights[name])
                p.copy_(weights[name])

    def materialise_state(self) -> None:
        """Create AdamW's state tensors with a zero step, so a checkpoint has shapes to load into."""
        for m in self.masters.values():
            m.grad = torch.zeros_like(m)
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, saved):
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

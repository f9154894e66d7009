"""Literal transcriptions of the public preference losses and pair selection that `tests/test_preference.py` checks
ours against, each a method body unchanged with its trainer's `self` passed in as a namespace of the attributes it
reads (`beta`, the loss switches, `accelerator.device`):

- `claire_qrpo_loss`: CLAIRE-Labo/quantile-reward-policy-optimization @ e93dcf142a8e89e79894bc04342cc7e9e8c2394b,
  src/qrpo/trainers/qrpo.py, `QRPOTrainer.qrpo_loss` (the paper's code; its four transforms).
- `apertus_qrpo_loss`, `apertus_dpo_loss`: swiss-ai/posttraining @ 22cbdc8eec1ac53fa1e3813d620c75b4b853df22,
  src/post_training/trainers/preference.py, `PreferenceTrainer.qrpo_loss` and `PreferenceTrainer.dpo_loss`.
- `select_chosen_rejected_pairs`, `compute_quantile_rewards`: swiss-ai/posttraining @
  80967ce57d08cee08108ab181d089f6e14af25b2, src/post_training/data_alignment/prepare_train_dataset_swissaiformat.py.

Both trainer files carry TRL's Apache-2.0 licence header (Copyright 2024 The HuggingFace Team); these excerpts are
reproduced under it for testing only. Type hints and docstrings are shortened; no statement is changed."""
import random
from typing import Any

import torch
import torch.nn.functional as F


def claire_qrpo_loss(
    self,
    model_outputs: dict[str, torch.Tensor],
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    ref_rewards: torch.Tensor,
    extra_logs: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, float | Any, float | Any]:
    """Compute the QRPO loss for a batch of policy and reference model log probabilities."""
    device = self.accelerator.device
    chosen_logps = model_outputs["chosen_logps"].to(device)
    rejected_logps = model_outputs["rejected_logps"].to(device)
    ref_chosen_logps = ref_chosen_logps.to(device)
    ref_rejected_logps = ref_rejected_logps.to(device)
    ref_rewards = ref_rewards.to(device)

    # Get the log ratios for the chosen and rejected responses
    logratio_chosen = chosen_logps - ref_chosen_logps
    logratio_rejected = rejected_logps - ref_rejected_logps

    percentile_chosen_rewards = (
        (ref_rewards <= chosen_rewards.unsqueeze(dim=-1)).float().mean(dim=1)
    )
    percentile_rejected_rewards = (
        (ref_rewards <= rejected_rewards.unsqueeze(dim=-1)).float().mean(dim=1)
    )

    num_ref_rewards = ref_rewards.shape[1]
    min_percentile = (
        1 / num_ref_rewards
    )  # For some transforms to avoid log(0) or icdf(0)
    max_percentile = (
        num_ref_rewards - 1
    ) / num_ref_rewards  # For some transforms to avoid icdf(1)

    if self.qrpo_transform_type in ["log"]:
        percentile_chosen_rewards = torch.clamp(
            percentile_chosen_rewards, min=min_percentile
        )  # to avoid log(0)
        percentile_rejected_rewards = torch.clamp(
            percentile_rejected_rewards, min=min_percentile
        )  # to avoid log(0)
    elif self.qrpo_transform_type in ["normal-icdf", "scaled-normal-icdf"]:
        percentile_chosen_rewards = torch.clamp(
            percentile_chosen_rewards, min=min_percentile, max=max_percentile
        )  # to avoid icdf(0) and icdf(1)
        percentile_rejected_rewards = torch.clamp(
            percentile_rejected_rewards, min=min_percentile, max=max_percentile
        )  # to avoid icdf(0) and icdf(1)

    extra_logs["percentile_rewards/chosen"] = percentile_chosen_rewards
    extra_logs["percentile_rewards/rejected"] = percentile_rejected_rewards

    if self.qrpo_transform_type == "log":
        modified_rewards_chosen = torch.log(percentile_chosen_rewards)
        modified_rewards_rejected = torch.log(percentile_rejected_rewards)
        Z = (self.beta / (1 + self.beta)) * torch.ones_like(modified_rewards_chosen)
        log_Z = torch.log(Z)
    elif self.qrpo_transform_type == "identity":
        modified_rewards_chosen = percentile_chosen_rewards
        modified_rewards_rejected = percentile_rejected_rewards
        beta = self.beta * torch.ones_like(modified_rewards_chosen)
        # Z = beta * (torch.exp(1 / beta) - 1) -> simplified to beta * torch.exp(1 / beta) -> use log directly
        log_Z = torch.log(beta) + 1 / beta
        # Also see the implementation for Apertus at
        # https://github.com/swiss-ai/posttraining/blob/93a2fd76a3beec975dd60320ba94f295d6af662a/src/post_training/trainers/preference.py#L1537
    elif self.qrpo_transform_type == "normal-icdf":
        normal_dist = torch.distributions.Normal(loc=0, scale=1)
        modified_rewards_chosen = normal_dist.icdf(percentile_chosen_rewards)
        modified_rewards_rejected = normal_dist.icdf(percentile_rejected_rewards)
        log_Z = (1 / (2 * self.beta**2)) * torch.ones_like(
            modified_rewards_chosen
        )
    elif self.qrpo_transform_type == "scaled-normal-icdf":
        normal_dist = torch.distributions.Normal(loc=0, scale=1)
        ref_rewards_std = ref_rewards.std(dim=1)
        normalized_ref_rewards_std = ref_rewards_std / torch.tensor(
            self.mean_std_ref_rewards
        )
        modified_rewards_chosen = normalized_ref_rewards_std * normal_dist.icdf(
            percentile_chosen_rewards
        )
        modified_rewards_rejected = normalized_ref_rewards_std * normal_dist.icdf(
            percentile_rejected_rewards
        )
        log_Z = (
            (normalized_ref_rewards_std**2) / (2 * self.beta**2)
        ) * torch.ones_like(modified_rewards_chosen)
    else:
        raise ValueError(
            f"Invalid qrpo_transform_type: {self.qrpo_transform_type}. Must be one of ['log', 'identity', 'normal_icdf', 'scaled-normal-icdf']"
        )

    extra_logs["modified_rewards/chosen"] = modified_rewards_chosen
    extra_logs["modified_rewards/rejected"] = modified_rewards_rejected
    extra_logs["log_Z"] = log_Z

    calibrated_reward_chosen = modified_rewards_chosen - self.beta * log_Z
    calibrated_reward_rejected = modified_rewards_rejected - self.beta * log_Z

    extra_logs["calibrated_rewards/chosen"] = calibrated_reward_chosen
    extra_logs["calibrated_rewards/rejected"] = calibrated_reward_rejected

    if self.qrpo_loss_type == "mae":
        loss_chosen = torch.abs(
            calibrated_reward_chosen - self.beta * logratio_chosen
        )
        loss_rejected = torch.abs(
            calibrated_reward_rejected - self.beta * logratio_rejected
        )
    elif self.qrpo_loss_type == "mse":
        loss_chosen = (calibrated_reward_chosen - self.beta * logratio_chosen) ** 2
        loss_rejected = (
            calibrated_reward_rejected - self.beta * logratio_rejected
        ) ** 2
    else:
        raise ValueError(
            f"Invalid qrpo_loss_type: {self.qrpo_loss_type}. Must be one of ['mae', 'mse']"
        )
    if self.qrpo_sample_selector == "chosen":
        loss_rejected = torch.zeros_like(loss_rejected)
    elif self.qrpo_sample_selector == "rejected":
        loss_chosen = torch.zeros_like(loss_chosen)
    elif self.qrpo_sample_selector == "both":
        pass
    elif self.qrpo_sample_selector == "random":
        # Random mask chosen or rejected iid for each example
        mask = torch.rand_like(loss_chosen) <= 0.5
        loss_chosen = torch.where(mask, loss_chosen, torch.zeros_like(loss_chosen))
        loss_rejected = torch.where(
            ~mask, loss_rejected, torch.zeros_like(loss_rejected)
        )
    else:
        raise ValueError(
            f"Invalid qrpo_sample_selector: {self.qrpo_sample_selector}. Must be one of ['chosen', 'rejected', 'both', 'random']"
        )

    losses = (loss_chosen + loss_rejected) / 2

    chosen_rewards_prediction = self.beta * logratio_chosen.detach()
    rejected_rewards_prediction = self.beta * logratio_rejected.detach()

    return losses, chosen_rewards_prediction, rejected_rewards_prediction


def apertus_qrpo_loss(
    self,
    model_outputs: dict[str, torch.Tensor],
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_quantile_rewards: torch.Tensor,
    rejected_quantile_rewards: torch.Tensor,
    ref_rewards: torch.Tensor,
    extra_logs: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, float | Any, float | Any]:
    """Compute the QRPO loss for a batch of policy and reference model log probabilities."""
    device = self.accelerator.device
    chosen_logps = model_outputs["chosen_logps"].to(device)
    rejected_logps = model_outputs["rejected_logps"].to(device)
    chosen_lens = model_outputs["chosen_lens"].to(device)
    rejected_lens = model_outputs["rejected_lens"].to(device)
    ref_chosen_logps = ref_chosen_logps.to(device)
    ref_rejected_logps = ref_rejected_logps.to(device)
    if ref_rewards is not None:
        ref_rewards = ref_rewards.to(device)
    else:
        assert (
            chosen_quantile_rewards is not None
            and rejected_quantile_rewards is not None
        ), "if ref_rewards is None, then chosen_quantile_rewards and rejected_quantile_rewards must be provided"
        chosen_quantile_rewards = chosen_quantile_rewards.to(device)
        rejected_quantile_rewards = rejected_quantile_rewards.to(device)

    # Get the log ratios for the chosen and rejected responses
    logratio_chosen = chosen_logps - ref_chosen_logps
    logratio_rejected = rejected_logps - ref_rejected_logps

    if ref_rewards is not None:
        chosen_quantile_rewards = (
            (ref_rewards <= chosen_rewards.unsqueeze(dim=-1)).float().mean(dim=1)
        )
        rejected_quantile_rewards = (
            (ref_rewards <= rejected_rewards.unsqueeze(dim=-1)).float().mean(dim=1)
        )

    extra_logs["quantile_rewards_chosen"] = chosen_quantile_rewards
    extra_logs["quantile_rewards_rejected"] = rejected_quantile_rewards

    _beta = torch.ones(chosen_logps.shape, device=device) * self.beta
    if self.normalize_beta_by_length:
        beta_chosen = _beta / chosen_lens
        beta_rejected = _beta / rejected_lens
    else:
        beta_chosen = _beta
        beta_rejected = _beta

    # clamp max to 0.1 otherwise grad norm is too high.
    beta_chosen = beta_chosen.clamp(max=0.1)
    beta_rejected = beta_rejected.clamp(max=0.1)

    extra_logs["beta_chosen"] = beta_chosen
    extra_logs["beta_rejected"] = beta_rejected

    def compute_beta_logZ(beta: torch.Tensor) -> torch.Tensor:
        """
        Apply approximation depending on beta logZ (when beta <= 0.2) for numerical stability.
                  beta * logZ = beta * log(beta * (exp(1 / beta) - 1))
                              = beta * log(beta) + beta * log(exp(1 / beta) - 1)
          (when beta <= 0.2) ~= beta * log(beta) + 1

        A trick to avoid CPU-GPU synchronization.
        With the clamp to max 0.1 above the approximation is always used so the trick is not needed, but we keep it for reference.
        """
        use_approx = (beta <= 0.2).float()
        beta_logZ = beta * torch.log(beta)
        beta = beta.clamp(
            min=0.2
        )  # doesn't have any effect apart from numerically avoiding the inf in the exp.
        beta_logZ += beta * torch.log(torch.exp(1 / beta) - 1) * (1 - use_approx)
        beta_logZ += 1 * use_approx
        return beta_logZ

    beta_logZ_chosen = compute_beta_logZ(beta_chosen)
    beta_logZ_rejected = compute_beta_logZ(beta_rejected)
    extra_logs["beta_logZ_chosen"] = beta_logZ_chosen
    extra_logs["beta_logZ_rejected"] = beta_logZ_rejected

    calibrated_targets_chosen = chosen_quantile_rewards - beta_logZ_chosen
    calibrated_targets_rejected = rejected_quantile_rewards - beta_logZ_rejected

    extra_logs["calibrated_targets_chosen"] = calibrated_targets_chosen.detach()
    extra_logs["calibrated_targets_rejected"] = calibrated_targets_rejected.detach()

    loss_chosen = (calibrated_targets_chosen - beta_chosen * logratio_chosen) ** 2
    loss_rejected = (
        calibrated_targets_rejected - beta_rejected * logratio_rejected
    ) ** 2

    if self.normalize_loss_by_length:
        loss_chosen = loss_chosen / chosen_lens
        loss_rejected = loss_rejected / rejected_lens

    extra_logs["loss_chosen"] = loss_chosen.detach()
    extra_logs["loss_rejected"] = loss_rejected.detach()

    losses = (loss_chosen + loss_rejected) / 2

    chosen_rewards_prediction = beta_chosen * logratio_chosen.detach()
    rejected_rewards_prediction = beta_rejected * logratio_rejected.detach()

    return losses, chosen_rewards_prediction, rejected_rewards_prediction


def apertus_dpo_loss(
    self,
    model_outputs: dict[str, torch.Tensor],
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_quantile_rewards: torch.Tensor,
    rejected_quantile_rewards: torch.Tensor,
    ref_rewards: torch.Tensor,
    extra_logs: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, float | Any, float | Any]:
    """Compute the DPO loss for a batch of policy and reference model log probabilities."""
    device = self.accelerator.device

    # using notation similar to DPOTrainer
    chosen_logps = model_outputs["chosen_logps"].to(device)
    rejected_logps = model_outputs["rejected_logps"].to(device)
    chosen_lens = model_outputs["chosen_lens"].to(device)
    rejected_lens = model_outputs["rejected_lens"].to(device)
    ref_chosen_logps = ref_chosen_logps.to(device)
    ref_rejected_logps = ref_rejected_logps.to(device)

    logratio_chosen = chosen_logps - ref_chosen_logps
    logratio_rejected = rejected_logps - ref_rejected_logps

    _beta = torch.ones(chosen_logps.shape, device=device) * self.beta
    if self.normalize_beta_by_length:
        beta_chosen = _beta / chosen_lens
        beta_rejected = _beta / rejected_lens
    else:
        beta_chosen = _beta
        beta_rejected = _beta

    extra_logs["beta_chosen"] = beta_chosen
    extra_logs["beta_rejected"] = beta_rejected

    losses = -F.logsigmoid(
        beta_chosen * logratio_chosen - beta_rejected * logratio_rejected
    )
    if self.normalize_loss_by_length:
        losses = losses / (chosen_lens / 2.0 + rejected_lens / 2.0)
    chosen_rewards_prediction = beta_chosen * logratio_chosen.detach()
    rejected_rewards_prediction = beta_rejected * logratio_rejected.detach()

    return losses, chosen_rewards_prediction, rejected_rewards_prediction


def select_chosen_rejected_pairs(row, num_pairs):
    # Sort conversation branches by reward.
    conv_branches = row["conversation_branches"]
    # Shuffle first to remove bias in the order of offline models.
    random.shuffle(conv_branches)
    conv_branches.sort(key=lambda x: x["quantile_reward"], reverse=True)
    row["conversation_branches"] = conv_branches

    # Heuristic to pick the training pairs.
    # For DPO it's usually better to pick rejected as worst and chosen as best.
    # For QRPO it doesn't matter there is no chosen and rejected, a good balance is good.
    # We have offline and off-policy samples. The quantile distribution is not clear.
    pairs = []

    worst_quantile_val = max(0.2, 1 / row["num_ref_rewards"])  # 0.2 is a heuristic
    best_quantile = [
        conv_branch
        for conv_branch in conv_branches
        if conv_branch["quantile_reward"] >= 1
    ]
    middle_quantile = [
        conv_branch
        for conv_branch in conv_branches
        if conv_branch["quantile_reward"] < 1
        and conv_branch["quantile_reward"] > worst_quantile_val
    ]
    worst_quantile = [
        conv_branch
        for conv_branch in conv_branches
        if conv_branch["quantile_reward"] <= worst_quantile_val
    ]

    # Pick one pair with one from the best and one from the worst quantile.
    if len(best_quantile) > 0:
        chosen = best_quantile.pop(0)
    elif len(middle_quantile) > 0:
        chosen = middle_quantile.pop(0)
    else:
        chosen = worst_quantile.pop(0)
    if len(worst_quantile) > 0:
        rejected = worst_quantile.pop(0)
    elif len(middle_quantile) > 0:
        rejected = middle_quantile.pop(0)
    else:
        rejected = best_quantile.pop(0)
    pairs.append((chosen, rejected))

    remaining_pairs = num_pairs - 1

    # Divide the remaining branches into > 0.5 and < 0.5 quantiles.
    if remaining_pairs > 0:
        remaining_convs = best_quantile + middle_quantile + worst_quantile

        top_quantile = [
            conv_branch
            for conv_branch in remaining_convs
            if conv_branch["quantile_reward"] >= 0.5
        ]
        bottom_quantile = [
            conv_branch
            for conv_branch in remaining_convs
            if conv_branch["quantile_reward"] < 0.5
        ]
        random.shuffle(top_quantile)
        random.shuffle(bottom_quantile)

        for _ in range(remaining_pairs):
            if len(top_quantile) > 0:
                chosen = top_quantile.pop(0)
            else:
                chosen = bottom_quantile.pop(0)

            if len(bottom_quantile) > 0:
                rejected = bottom_quantile.pop(0)
            else:
                rejected = top_quantile.pop(0)

            pair = [chosen, rejected]
            pair.sort(key=lambda x: x["quantile_reward"], reverse=True)
            pairs.append(pair)

    row["chosen_rejected_pairs"] = pairs
    return row


def compute_quantile_rewards(row):
    ref_rewards = row["ref_rewards"]
    for i, conv_branch in enumerate(row["conversation_branches"]):
        r = conv_branch["reward"]
        quantile_reward = sum(ref_reward <= r for ref_reward in ref_rewards) / len(
            ref_rewards
        )
        row["conversation_branches"][i]["quantile_reward"] = quantile_reward
    return row

"""The MARS attention mask and losses (docs/algorithm.md, "Training") on a tiny random Llama."""

import pytest
import torch
import torch.nn.functional as F
from tests.tiny_fixtures import tiny_causal_lm

from finetune.losses import (
    HEAD_ROW_MULTIPLE,
    IGNORE_INDEX,
    MarsLossSettings,
    ar_loss,
    batched_mars_attention_mask,
    head_logits,
    mars_attention_mask,
    mars_inputs,
    mars_loss,
)

VOCAB, MASK_ID = 48, 47

# n = 8, B = 4; rows are queries, columns keys; [noisy 0..7 | clean 0..7].
EXPECTED_N8_B4 = """
1000000000000000
1100000000000000
1110000000000000
1111000000000000
0000100011110000
0000110011110000
0000111011110000
0000111111110000
0000000010000000
0000000011000000
0000000011100000
0000000011110000
0000000011111000
0000000011111100
0000000011111110
0000000011111111
"""


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm(VOCAB, context=128)


def make_batch(lengths, prompt_lengths, seed=0):
    """Right-padded batch; labels -100 on the prompt and on padding; pad id 0 (a real token id on purpose)."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    input_ids = torch.zeros(len(lengths), n, dtype=torch.long)
    labels = torch.full((len(lengths), n), IGNORE_INDEX)
    valid = torch.zeros(len(lengths), n, dtype=torch.bool)
    for i, (k, p) in enumerate(zip(lengths, prompt_lengths)):
        input_ids[i, :k] = torch.randint(1, VOCAB - 1, (k,), generator=g)
        labels[i, p:k] = input_ids[i, p:k]
        valid[i, :k] = True
    return input_ids, labels, valid


def all_logits(model, ids, positions, attn):
    return model(input_ids=ids, attention_mask=attn, position_ids=positions).logits


def test_mask_n8_b4_equals_hand_written_matrix():
    expected = torch.tensor([[c == "1" for c in row] for row in EXPECTED_N8_B4.split()])
    assert torch.equal(mars_attention_mask(8, 4), expected)


def test_cropped_mask_is_the_full_mask_without_the_dropped_noisy_rows():
    full = mars_attention_mask(12, 4)
    keep = list(range(4, 12)) + list(range(12, 24))  # noisy 4..11, clean 0..11
    assert torch.equal(mars_attention_mask(12, 4, noisy_start=4), full[keep][:, keep])


def test_padded_keys_are_hidden_and_pad_rows_attend_to_themselves():
    valid = torch.tensor([[True] * 6 + [False] * 2])
    mask = batched_mars_attention_mask(valid, 4)[0, 0]  # [16, 16]
    assert mask.shape == (16, 16)
    pad_keys = torch.tensor([6, 7, 14, 15])
    off_diagonal = mask.clone().fill_diagonal_(False)
    assert not off_diagonal[:, pad_keys].any()
    assert mask.diagonal().all()
    assert torch.equal(mask[:6, :6], mars_attention_mask(8, 4)[:6, :6])


@torch.no_grad()
def test_clean_half_logits_equal_a_plain_causal_forward(model):
    input_ids, labels, valid = make_batch([12], [5])
    ids, positions, attn = mars_inputs(input_ids, labels, valid, MASK_ID, 4)
    clean = all_logits(model, ids, positions, attn)[:, 12:]
    plain = model(input_ids=input_ids).logits
    torch.testing.assert_close(clean, plain, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("k", [0, 1, 2])
def test_changing_clean_block_k_leaves_noisy_blocks_up_to_k_unchanged(model, k):
    n, B = 16, 4
    input_ids, labels, valid = make_batch([n], [3])
    ids, positions, attn = mars_inputs(input_ids, labels, valid, MASK_ID, B)
    changed = ids.clone()
    block = slice(n + k * B, n + (k + 1) * B)  # clean half, block k
    changed[:, block] = (changed[:, block] + 1) % (VOCAB - 1)
    before = all_logits(model, ids, positions, attn)[:, :n]
    after = all_logits(model, changed, positions, attn)[:, :n]
    upto = (k + 1) * B
    assert torch.equal(before[:, :upto], after[:, :upto])  # no leak into blocks <= k
    assert not torch.allclose(before[:, upto:], after[:, upto:])  # later blocks do read it


def reference_ce(logits, labels):
    """CE from full logits with the usual causal shift (the slow reference)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def test_mars_loss_matches_full_logit_reference_and_ar_weight_zero_is_noisy_ce_alone(model):
    input_ids, labels, valid = make_batch([14, 9, 12], [5, 3, 7], seed=1)
    n = input_ids.shape[1]
    ids, positions, attn = mars_inputs(input_ids, labels, valid, MASK_ID, 4)
    logits = all_logits(model, ids, positions, attn)
    noisy_ce, clean_ce = reference_ce(logits[:, :n], labels), reference_ce(logits[:, n:], labels)

    zero = mars_loss(model, input_ids, labels, valid, MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=0.0))
    torch.testing.assert_close(zero.loss, noisy_ce, atol=1e-5, rtol=0)
    torch.testing.assert_close(zero.loss_ar, clean_ce, atol=1e-5, rtol=0)  # reported, not trained

    half = mars_loss(model, input_ids, labels, valid, MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=0.5))
    torch.testing.assert_close(half.loss, noisy_ce + 0.5 * clean_ce, atol=1e-5, rtol=0)
    torch.testing.assert_close(half.loss_mask, noisy_ce, atol=1e-5, rtol=0)

    # label smoothing (an option, off by default) reaches the noisy stream only
    smooth_noisy = F.cross_entropy(logits[:, : n - 1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                   ignore_index=IGNORE_INDEX, label_smoothing=0.1)
    smooth = mars_loss(model, input_ids, labels, valid,
                       MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=0.5, mask_label_smoothing=0.1))
    assert smooth_noisy > noisy_ce + 1e-3
    torch.testing.assert_close(smooth.loss_mask, smooth_noisy, atol=1e-5, rtol=0)
    torch.testing.assert_close(smooth.loss_ar, clean_ce, atol=1e-5, rtol=0)
    torch.testing.assert_close(smooth.loss, smooth_noisy + 0.5 * clean_ce, atol=1e-5, rtol=0)


@torch.no_grad()
def test_skipping_prompt_only_noisy_blocks_does_not_change_the_loss(model):
    input_ids, labels, valid = make_batch([20, 17], [11, 9], seed=2)
    kwargs = dict(block_size=4, mask_id=MASK_ID, ar_weight=1.0)
    full = mars_loss(model, input_ids, labels, valid, MarsLossSettings(skip_prompt_blocks=False, **kwargs))
    cropped = mars_loss(model, input_ids, labels, valid, MarsLossSettings(skip_prompt_blocks=True, **kwargs))
    torch.testing.assert_close(cropped.loss, full.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(cropped.loss_mask, full.loss_mask, atol=1e-5, rtol=0)


@torch.no_grad()
def test_padding_does_not_change_a_rows_logits(model):
    long_ids, long_labels, long_valid = make_batch([16], [4], seed=3)
    short_ids, short_labels, short_valid = make_batch([10], [4], seed=4)
    batch_ids = torch.cat([long_ids, F.pad(short_ids, (0, 6), value=0)])
    batch_labels = torch.cat([long_labels, F.pad(short_labels, (0, 6), value=IGNORE_INDEX)])
    batch_valid = torch.cat([long_valid, F.pad(short_valid, (0, 6), value=False)])
    alone = all_logits(model, *mars_inputs(short_ids, short_labels, short_valid, MASK_ID, 4))
    batched = all_logits(model, *mars_inputs(batch_ids, batch_labels, batch_valid, MASK_ID, 4))[1:]
    torch.testing.assert_close(batched[:, :10], alone[:, :10], atol=1e-5, rtol=0)  # noisy half
    torch.testing.assert_close(batched[:, 16:26], alone[:, 10:], atol=1e-5, rtol=0)  # clean half
    assert torch.isfinite(batched).all()


@torch.no_grad()
def test_ar_loss_equals_transformers_own_causal_lm_loss(model):
    input_ids, labels, valid = make_batch([14, 9], [5, 3], seed=5)
    ours = ar_loss(model, input_ids, labels, valid)
    theirs = model(input_ids=input_ids, attention_mask=valid.long(), labels=labels).loss
    torch.testing.assert_close(ours.loss, theirs, atol=1e-5, rtol=0)
    assert ours.loss_mask is None


@torch.no_grad()
def test_eager_attention_gives_the_sdpa_losses(model):
    """Training may run the eager kernel (--attention eager); it adds the mask to the scores, so the
    boolean MARS mask must reach it as 0 / -inf-like floats or it would hide nothing."""
    import copy

    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    input_ids, labels, valid = make_batch([14, 9, 12], [5, 3, 7], seed=6)
    kwargs = dict(block_size=4, mask_id=MASK_ID, ar_weight=1.0)
    sdpa_out = mars_loss(model, input_ids, labels, valid, MarsLossSettings(**kwargs))
    eager_out = mars_loss(eager, input_ids, labels, valid, MarsLossSettings(**kwargs))
    torch.testing.assert_close(eager_out.loss_mask, sdpa_out.loss_mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(eager_out.loss_ar, sdpa_out.loss_ar, atol=1e-5, rtol=0)
    torch.testing.assert_close(ar_loss(eager, input_ids, labels, valid).loss,
                               ar_loss(model, input_ids, labels, valid).loss, atol=1e-5, rtol=0)


@torch.no_grad()
def test_the_training_module_passes_mask_label_smoothing_to_the_loss(model):
    from finetune.config import TrainConfig
    from finetune.train_model import TrainModule

    input_ids, labels, valid = make_batch([14, 9, 12], [5, 3, 7], seed=1)
    cfg = TrainConfig(stage="mars", block_size=4, ar_weight=1.0, mask_label_smoothing=0.2)
    got = TrainModule(model, cfg, MASK_ID)(input_ids, labels, valid)
    want = mars_loss(model, input_ids, labels, valid,
                     MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=1.0, mask_label_smoothing=0.2))
    plain = mars_loss(model, input_ids, labels, valid, MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=1.0))
    torch.testing.assert_close(got.loss_mask, want.loss_mask, atol=1e-6, rtol=0)
    assert abs(float(got.loss_mask) - float(plain.loss_mask)) > 1e-3


# ----------------------------------------------------------------------------- shifted block grid

def spec_rules_mask(n: int, B: int, r: int) -> torch.Tensor:
    """docs/algorithm.md's four attention rules, entry by entry, with block(i) = (i + r) // B (r = 0: the paper's)."""
    def block(i):
        return (i + r) // B

    mask = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            mask[q, k] = block(k) == block(q) and k <= q       # noisy -> noisy
            mask[q, n + k] = block(k) < block(q)               # noisy -> clean
            mask[n + q, n + k] = k <= q                        # clean -> clean; clean -> noisy stays False
    return mask


@pytest.mark.parametrize("r", [0, 1, 2, 3])
def test_a_shifted_block_grid_follows_the_spec_rules_on_shifted_blocks(r):
    hand = torch.tensor([[c == "1" for c in row] for row in EXPECTED_N8_B4.split()])
    assert torch.equal(spec_rules_mask(8, 4, 0), hand)            # the reference itself is right at r = 0
    assert torch.equal(mars_attention_mask(8, 4, block_offset=r), spec_rules_mask(8, 4, r))
    full = mars_attention_mask(12, 4, block_offset=r)
    for s in [s for s in range(1, 12) if (s + r) % 4 == 0]:       # cropping the noisy half at a block start
        keep = torch.cat([torch.arange(s, 12), torch.arange(12, 24)])
        assert torch.equal(mars_attention_mask(12, 4, noisy_start=s, block_offset=r), full[keep][:, keep])
    if r:
        assert not torch.equal(mars_attention_mask(8, 4, block_offset=r), hand)


def test_a_block_offset_outside_the_block_is_refused():
    with pytest.raises(ValueError, match="block_offset=4"):
        mars_attention_mask(8, 4, block_offset=4)


@torch.no_grad()
@pytest.mark.parametrize("r,k", [(1, 1), (3, 2)])
def test_with_a_shifted_grid_changing_clean_block_k_leaves_noisy_blocks_up_to_k_unchanged(model, r, k):
    n, B = 16, 4
    input_ids, labels, valid = make_batch([n], [3])
    ids, positions, attn = mars_inputs(input_ids, labels, valid, MASK_ID, B, block_offset=r)
    in_block = [i for i in range(n) if (i + r) // B == k]
    changed = ids.clone()
    changed[:, [n + i for i in in_block]] = (changed[:, [n + i for i in in_block]] + 1) % (VOCAB - 1)
    before = all_logits(model, ids, positions, attn)[:, :n]
    after = all_logits(model, changed, positions, attn)[:, :n]
    upto = in_block[-1] + 1
    assert torch.equal(before[:, :upto], after[:, :upto])
    assert not torch.allclose(before[:, upto:], after[:, upto:])


@torch.no_grad()
@pytest.mark.parametrize("r", [1, 2, 3])
def test_skipping_prompt_blocks_is_exact_on_a_shifted_grid_and_the_grid_changes_the_loss(model, r):
    input_ids, labels, valid = make_batch([20, 17], [11, 9], seed=2)
    kwargs = dict(block_size=4, mask_id=MASK_ID, ar_weight=1.0, block_offset=r)
    full = mars_loss(model, input_ids, labels, valid, MarsLossSettings(skip_prompt_blocks=False, **kwargs))
    cropped = mars_loss(model, input_ids, labels, valid, MarsLossSettings(skip_prompt_blocks=True, **kwargs))
    torch.testing.assert_close(cropped.loss, full.loss, atol=1e-5, rtol=0)
    unshifted = mars_loss(model, input_ids, labels, valid,
                          MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=1.0))
    torch.testing.assert_close(full.loss_ar, unshifted.loss_ar, atol=1e-5, rtol=0)   # the clean stream is causal
    assert abs(float(full.loss_mask) - float(unshifted.loss_mask)) > 1e-4


@torch.no_grad()
def test_random_block_offsets_reach_the_loss_and_depend_only_on_seed_and_step(model):
    from finetune.config import TrainConfig
    from finetune.schedule import block_offset_at
    from finetune.train_model import TrainModule

    cfg = TrainConfig(stage="mars", block_size=4, random_block_offset=True, seed=3)
    offsets = [block_offset_at(cfg, i) for i in range(64)]
    assert set(offsets) == {0, 1, 2, 3}
    assert offsets == [block_offset_at(TrainConfig(stage="mars", block_size=4, random_block_offset=True, seed=3), i)
                       for i in range(64)]                             # a resumed run draws the same grid
    assert [block_offset_at(TrainConfig(stage="mars", block_size=4, seed=3), i) for i in range(64)] == [0] * 64
    assert block_offset_at(TrainConfig(stage="ar-sft", random_block_offset=True), 5) == 0

    input_ids, labels, valid = make_batch([14, 9, 12], [5, 3, 7], seed=1)
    got = TrainModule(model, cfg, MASK_ID)(input_ids, labels, valid, block_offset=2)
    want = mars_loss(model, input_ids, labels, valid,
                     MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=1.0, block_offset=2))
    torch.testing.assert_close(got.loss_mask, want.loss_mask, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- soft targets (issue 29)

def test_a_one_hot_teacher_gives_exactly_the_hard_cross_entropy():
    from finetune.losses import soft_target_loss

    g = torch.Generator().manual_seed(7)
    student = torch.randn(6, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (6,), generator=g)
    one_hot = torch.full((6, VOCAB), -1e4).scatter(1, labels.unsqueeze(1), 1e4)   # softmax is exactly one-hot
    want = F.cross_entropy(student, labels)
    torch.testing.assert_close(soft_target_loss(student, one_hot), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(soft_target_loss(student, one_hot, top_k=5), want, atol=1e-6, rtol=0)


def test_the_soft_target_loss_is_kl_and_top_k_renormalises_the_teacher():
    from finetune.losses import soft_target_loss

    g = torch.Generator().manual_seed(8)
    student, teacher = torch.randn(5, VOCAB, generator=g), torch.randn(5, VOCAB, generator=g)
    p, log_q = teacher.softmax(-1), student.log_softmax(-1)
    torch.testing.assert_close(soft_target_loss(student, teacher), (p * (p.log() - log_q)).sum(-1).mean(),
                               atol=1e-6, rtol=0)
    assert float(soft_target_loss(teacher, teacher)) < 1e-6
    top, idx = teacher.topk(3, dim=-1)
    p3 = top.softmax(-1)
    want = (p3 * (p3.log() - log_q.gather(-1, idx))).sum(-1).mean()
    torch.testing.assert_close(soft_target_loss(student, teacher, top_k=3), want, atol=1e-6, rtol=0)


def test_no_gradient_reaches_the_teacher_through_the_soft_target():
    from finetune.losses import soft_target_loss

    g = torch.Generator().manual_seed(9)
    student = torch.randn(4, VOCAB, generator=g, requires_grad=True)
    teacher = torch.randn(4, VOCAB, generator=g, requires_grad=True)
    (soft_target_loss(student, teacher) + 0 * teacher.sum()).backward()   # 0 * sum: the teacher gets a .grad
    assert student.grad.abs().sum() > 0
    assert torch.equal(teacher.grad, torch.zeros_like(teacher))


def test_soft_weight_mixes_hard_ce_and_kl_to_the_clean_stream_and_reports_the_hard_ce(model):
    from finetune.losses import soft_target_loss

    input_ids, labels, valid = make_batch([14, 9, 12], [5, 3, 7], seed=1)
    n = input_ids.shape[1]
    with torch.no_grad():
        logits = all_logits(model, *mars_inputs(input_ids, labels, valid, MASK_ID, 4))
    rows = shift_rows(labels)
    kl = soft_target_loss(logits[:, :n][rows], logits[:, n:][rows])
    hard = mars_loss(model, input_ids, labels, valid, MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=1.0))
    for w in (0.5, 1.0):
        soft = mars_loss(model, input_ids, labels, valid,
                         MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=1.0, soft_weight=w))
        torch.testing.assert_close(soft.loss, (1 - w) * hard.loss_mask + w * kl + hard.loss_ar, atol=1e-5, rtol=0)
        torch.testing.assert_close(soft.loss_mask, hard.loss_mask, atol=1e-5, rtol=0)   # comparable across runs
    alone = mars_loss(model, input_ids, labels, valid,
                      MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=0.0, soft_weight=1.0))
    torch.testing.assert_close(alone.loss, kl, atol=1e-5, rtol=0)


def shift_rows(labels):
    """Positions whose output predicts a label: the output at i predicts label i + 1."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1) != IGNORE_INDEX


def test_with_kl_alone_and_no_ar_loss_the_clean_logits_get_no_gradient_of_their_own():
    """ar_weight 0 and soft weight 1: the loss still moves the weights, but only through the mask rows' outputs —
    the clean rows' logits, the teacher, are no input of the backward pass."""
    model = tiny_causal_lm(VOCAB, context=128)
    input_ids, labels, valid = make_batch([14, 9], [5, 3], seed=4)
    seen = []
    model.lm_head.register_full_backward_hook(lambda mod, gin, gout: seen.append(gout[0]))
    out = mars_loss(model, input_ids, labels, valid,
                    MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=0.0, soft_weight=1.0))
    out.loss.backward()
    rows = int(shift_rows(labels).sum())
    # one LM-head call per stream (on the rows rounded up to a multiple of 64, the padding rows getting no
    # gradient); only the mask stream's output carries a gradient
    padded = -(-rows // HEAD_ROW_MULTIPLE) * HEAD_ROW_MULTIPLE
    assert len(seen) == 1 and seen[0].shape[0] == padded and seen[0][:rows].abs().sum() > 0
    assert not seen[0][rows:].any()
    assert model.lm_head.weight.grad is not None


def test_the_training_module_passes_the_soft_target_settings_and_bad_values_name_the_fix(model):
    from finetune.config import TrainConfig
    from finetune.train_model import TrainModule

    input_ids, labels, valid = make_batch([14, 9, 12], [5, 3, 7], seed=1)
    cfg = TrainConfig(stage="mars", soft_target_weight=0.5, soft_target_top_k=4)
    with torch.no_grad():
        got = TrainModule(model, cfg, MASK_ID)(input_ids, labels, valid)
        want = mars_loss(model, input_ids, labels, valid,
                         MarsLossSettings(block_size=4, mask_id=MASK_ID, soft_weight=0.5, soft_top_k=4))
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="soft_target_weight=1.5"):
        TrainConfig(soft_target_weight=1.5)
    with pytest.raises(ValueError, match="soft_target_top_k=-1"):
        TrainConfig(soft_target_top_k=-1)


# ----------------------------------------------------------------------------- gated LoRA: a frozen clean stream

@pytest.mark.parametrize("kind,attention,mask_row,tie,soft,offset", [
    ("llama", "sdpa", False, False, 0.0, 0), ("llama", "eager", True, True, 0.0, 1),
    ("qwen2", "sdpa", True, True, 0.5, 3), ("qwen2", "sdpa", True, False, 0.0, 2)])
def test_a_gated_run_trains_the_masks_exactly_as_the_joint_forward_with_no_backward_through_the_clean_stream(
        kind, attention, mask_row, tie, soft, offset):
    from finetune.config import TrainConfig
    from finetune.train_model import TrainModule, prepare_model

    cfg = TrainConfig(stage="mars", block_size=4, lora=True, lora_r=4, lora_dropout=0.0, gated_lora=True,
                      train_mask_row=mask_row, attention=attention, soft_target_weight=soft)
    module = TrainModule(prepare_model(tiny_causal_lm(VOCAB, kind, context=128, tie=tie), cfg, None), cfg, MASK_ID)
    trained = [p for p in module.parameters() if p.requires_grad]
    assert (module.mask_row is not None) == mask_row and (not mask_row or module.mask_row.tied == tie)
    torch.manual_seed(1)
    with torch.no_grad():   # LoRA's B starts at zero, which would make every delta (and most gradients) vanish
        for p in trained:
            p.add_(0.2 * torch.randn_like(p))
    input_ids, labels, valid = make_batch([14, 9, 12], [5, 3, 7], seed=2)
    lm = module.causal_lm()
    grad_modes = []
    lm.model.register_forward_hook(lambda *args: grad_modes.append(torch.is_grad_enabled()))

    def run(frozen):
        module.zero_grad()
        out = mars_loss(lm, input_ids, labels, valid,
                        MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=1.0, block_offset=offset,
                                         soft_weight=soft, frozen_clean=frozen))
        out.loss.backward()
        return out, [p.grad.clone() for p in trained]

    joint, joint_grads = run(False)
    assert grad_modes == [True]
    frozen, frozen_grads = run(True)
    assert grad_modes == [True, False, True]   # clean half without a graph, then the noisy half
    for field in ("loss", "loss_mask", "loss_ar"):
        torch.testing.assert_close(getattr(frozen, field), getattr(joint, field), atol=1e-5, rtol=0)
    assert sum(float(g.abs().sum()) for g in joint_grads) > 0
    for a, b in zip(frozen_grads, joint_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # a real token equal to the mask id turns the gate on in the clean stream: that batch takes the joint forward
    kept, input_ids[0, 1] = int(input_ids[0, 1]), MASK_ID
    joint, joint_grads = run(False)
    grad_modes.clear()
    frozen, frozen_grads = run(True)
    assert grad_modes == [True]
    torch.testing.assert_close(frozen.loss, joint.loss, atol=0, rtol=0)
    input_ids[0, 1] = kept
    # the module itself takes this path whenever LoRA is gated
    grad_modes.clear()
    with torch.no_grad():
        module(input_ids, labels, valid, block_offset=offset)
    assert grad_modes == [False, False]


# ----------------------------------------------------------------------------- an anchor for the clean stream

def test_an_anchor_replaces_part_of_the_clean_ce_by_the_kl_from_the_anchors_own_causal_forward(model):
    from finetune.losses import soft_target_loss

    anchor = tiny_causal_lm(VOCAB, context=128, seed=7, head_scale=20.0)   # confident: a KL well above 0
    input_ids, labels, valid = make_batch([14, 9, 12], [5, 3, 7], seed=1)
    n = input_ids.shape[1]
    rows = shift_rows(labels)
    with torch.no_grad():
        clean = all_logits(model, *mars_inputs(input_ids, labels, valid, MASK_ID, 4))[:, n:][rows]
        theirs = anchor(input_ids=input_ids, attention_mask=valid.long()).logits[rows]   # the stock forward
    kl = soft_target_loss(clean, theirs)
    assert float(kl) > 0.1   # a different model: the term is not trivially zero
    hard = mars_loss(model, input_ids, labels, valid, MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=0.5))
    for w in (0.3, 1.0):
        got = mars_loss(model, input_ids, labels, valid,
                        MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=0.5, anchor_weight=w), anchor)
        want = hard.loss_mask + 0.5 * ((1 - w) * hard.loss_ar + w * kl)
        torch.testing.assert_close(got.loss, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.loss_ar, hard.loss_ar, atol=1e-6, rtol=0)   # still the clean CE
        torch.testing.assert_close(got.loss_mask, hard.loss_mask, atol=1e-6, rtol=0)


def test_anchored_to_itself_with_kl_alone_the_clean_stream_adds_no_gradient():
    """At the anchor the KL is at its minimum: its gradient is zero, so only the mask CE moves the weights (the
    hard clean CE would add a gradient of its own)."""
    import copy

    model = tiny_causal_lm(VOCAB, context=128)
    anchor = copy.deepcopy(model).requires_grad_(False)
    input_ids, labels, valid = make_batch([14, 9], [5, 3], seed=4)

    def grads(settings, *extra):
        model.zero_grad()
        out = mars_loss(model, input_ids, labels, valid, settings, *extra)
        out.loss.backward()
        return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    anchored, g_anchored = grads(MarsLossSettings(block_size=4, mask_id=MASK_ID, anchor_weight=1.0), anchor)
    masks, g_masks = grads(MarsLossSettings(block_size=4, mask_id=MASK_ID, ar_weight=0.0))
    _, g_hard = grads(MarsLossSettings(block_size=4, mask_id=MASK_ID))
    torch.testing.assert_close(anchored.loss, masks.loss, atol=1e-5, rtol=0)
    for k in g_masks:
        torch.testing.assert_close(g_anchored[k], g_masks[k], atol=1e-5, rtol=1e-4)
    assert any(not torch.allclose(g_hard[k], g_masks[k], atol=1e-4) for k in g_masks)


def test_the_anchor_settings_name_the_fix_and_the_module_refuses_another_vocabulary(model, tmp_path):
    from finetune.config import TrainConfig
    from finetune.train_model import TrainModule
    from tests.tiny_fixtures import make_tiny_model_dir

    for bad, match in [(dict(ar_anchor="m", ar_anchor_weight=0.0), "ar_anchor_weight=0.0"),
                       (dict(ar_anchor="m", ar_anchor_weight=1.5), "ar_anchor_weight=1.5"),
                       (dict(ar_anchor="m", stage="ar-sft"), "ar_anchor='m'"),
                       (dict(ar_anchor="m", soft_target_weight=0.5), "soft-target-weight"),
                       (dict(ar_anchor="m", lora=True, gated_lora=True), "gated-lora"),
                       (dict(ar_anchor="m", ar_weight=0.0), "ar_weight > 0")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad)
    other = make_tiny_model_dir(tmp_path / "other")   # the repo's tiny model folder: not this fixture's vocabulary
    with pytest.raises(ValueError, match="vocabulary"):
        TrainModule(model, TrainConfig(stage="mars", ar_anchor=str(other)), MASK_ID)


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 200])
def test_the_lm_head_runs_on_a_multiple_of_64_rows_and_gives_the_same_values_and_gradients(rows):
    # The labelled-row count changes every step; the head's matmul sees few shapes (finetune.losses.head_logits).
    torch.manual_seed(rows)
    head = torch.nn.Linear(16, 50, bias=False)
    seen = []
    head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    h1 = torch.randn(rows, 16, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    target = torch.randint(0, 50, (rows,))
    padded = head_logits(head, h1)
    assert padded.shape == (rows, 50) and padded.dtype == torch.float32
    assert seen == [-(-rows // HEAD_ROW_MULTIPLE) * HEAD_ROW_MULTIPLE] and seen[0] % 64 == 0
    F.cross_entropy(padded, target).backward()
    grad_weight, head.weight.grad = head.weight.grad.clone(), None
    plain = head(h2).float()
    F.cross_entropy(plain, target).backward()
    torch.testing.assert_close(padded, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_weight, head.weight.grad, rtol=1e-5, atol=1e-7)

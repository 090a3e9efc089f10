"""The sparse MLM loss's row selection: a count of the labelled positions known on the host picks
exactly the rows ``nonzero`` picks, in the same order, so the loss and its gradients are bitwise
those of the plain path; a count belongs to the labels of the forward that prepared it. On CUDA
(``gpu``), the count is queued before the encoder and the forward and backward after it read
nothing back from the device."""

import pytest
import torch

from dslab.models import bert
from dslab.models.bert import BertForPreTraining, LabelCount, bert_tiny, labelled_rows

BATCH, SEQ = 3, 24


def _config(**overrides):
    return bert_tiny(hidden_dropout=0.0, attention_dropout=0.0, **overrides)


def _batch(seed, p_label=0.3, device="cpu", batch=BATCH, seq=SEQ, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    types = torch.randint(0, 2, (batch, seq), generator=g)
    picked = torch.rand(batch, seq, generator=g) < p_label
    labels = torch.where(picked, ids, torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return ids.to(device), types.to(device), labels.to(device), nsp.to(device)


def _spy_counts(monkeypatch) -> list:
    """The ``count`` of every :func:`labelled_rows` call the model makes, in order."""
    counts = []
    real = bert.labelled_rows

    def spy(mask, count=None):
        counts.append(count)
        return real(mask, count)

    monkeypatch.setattr(bert, "labelled_rows", spy)
    return counts


def _host_count(labels):
    """A count already on the host, as :meth:`LabelCount.queue` leaves it once its copy is done."""
    return LabelCount(labels, (labels != -100).sum())


@pytest.mark.parametrize("numel", [0, 1, 7, 1000])
@pytest.mark.parametrize("p_true", [0.0, 0.15, 0.5, 1.0])
def test_labelled_rows_with_a_count_match_nonzero(numel, p_true):
    g = torch.Generator().manual_seed(numel)
    for _ in range(5):
        mask = torch.rand(numel, generator=g) < p_true
        want = mask.nonzero(as_tuple=True)[0]
        assert torch.equal(labelled_rows(mask), want)
        got = labelled_rows(mask, int(mask.sum()))
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want)


def test_labelled_rows_rejects_a_count_outside_the_mask():
    mask = torch.tensor([True, False, True])
    with pytest.raises(ValueError, match="count=4"):
        labelled_rows(mask, 4)
    with pytest.raises(ValueError, match="count=-1"):
        labelled_rows(mask, -1)


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
@pytest.mark.parametrize("p_label", [0.0, 0.3, 1.0])
def test_count_path_gives_the_plain_loss_and_gradients(kernels, p_label):
    torch.manual_seed(0)
    model = BertForPreTraining(_config(), kernels=kernels)
    ids, types, labels, _ = _batch(seed=1, p_label=p_label)

    def run(label_count):
        model.zero_grad(set_to_none=True)
        loss = model.mlm_loss(model.encode(ids, types), labels, label_count=label_count)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain_grads = run(None)
    loss, grads = run(_host_count(labels))
    bitwise = dict(rtol=0.0, atol=0.0, equal_nan=True)  # no label at all: the mean is 0/0 on both paths
    torch.testing.assert_close(loss, plain_loss, **bitwise)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], **bitwise, msg=name)


def test_a_count_is_refused_for_other_labels():
    model = BertForPreTraining(_config(), kernels="torch")
    ids, types, labels, _ = _batch(seed=2)
    hidden = model.encode(ids, types)
    count = _host_count(labels)
    with pytest.raises(ValueError, match="another labels tensor"):
        model.mlm_loss(hidden, labels.clone(), label_count=count)  # equal values, another batch's tensor


def test_each_forward_uses_the_count_of_its_own_labels(monkeypatch):
    """The count path forced on CPU: every forward prepares a count for its own labels, its loss
    reads exactly that count, no count outlives the forward on the model, and ``mlm_loss`` called
    afterwards without one takes the plain path."""
    torch.manual_seed(0)
    model = BertForPreTraining(_config(), kernels="torch").eval()
    batches = [_batch(seed=3, p_label=0.1), _batch(seed=4, p_label=0.6), _batch(seed=5, p_label=0.3)]
    with torch.no_grad():
        plain = [model(ids, types, masked_lm_labels=labels, next_sentence_label=nsp)
                 for ids, types, labels, nsp in batches]

    prepared = []

    def label_count_ahead(self, labels):
        prepared.append(_host_count(labels))
        return prepared[-1]

    monkeypatch.setattr(BertForPreTraining, "label_count_ahead", label_count_ahead)
    used = _spy_counts(monkeypatch)
    with torch.no_grad():
        for (ids, types, labels, nsp), want in zip(batches, plain):
            loss = model(ids, types, masked_lm_labels=labels, next_sentence_label=nsp)
            assert torch.equal(loss, want)
            assert prepared[-1].labels is labels
            assert not any(isinstance(v, LabelCount) for v in vars(model).values())
        assert used == [int((labels != -100).sum()) for _, _, labels, _ in batches]
        assert len(set(used)) == len(batches)  # the batches' counts differ, so a stale one would show
        ids, types, labels, _ = batches[0]
        model.mlm_loss(model.encode(ids, types), labels)
    assert used[-1] is None


def test_no_count_is_prepared_off_cuda_or_for_dense_mlm():
    _, _, labels, _ = _batch(seed=6)
    assert BertForPreTraining(_config(), kernels="torch").label_count_ahead(labels) is None  # CPU labels
    assert BertForPreTraining(_config(), kernels="torch").label_count_ahead(None) is None


# ---------------------------------------------------------------------------------------------
# On CUDA.
# ---------------------------------------------------------------------------------------------


def _cuda_model(kernels, **overrides):
    torch.manual_seed(0)
    return BertForPreTraining(_config(**overrides), kernels=kernels).cuda()


def _step(model, ids, types, labels, nsp):
    model.zero_grad(set_to_none=True)
    loss = model(ids, types, masked_lm_labels=labels, next_sentence_label=nsp)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _plain_step(model, ids, types, labels, nsp):
    """The same loss through today's path: ``mlm_loss`` without a count selects with ``nonzero``."""
    model.zero_grad(set_to_none=True)
    hidden = model.encode(ids, types)
    loss = model.mlm_loss(hidden, labels) + model.ops.softmax_cross_entropy(model.nsp_head(hidden), nsp, -100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["torch", "dslab"])
def test_cuda_count_path_matches_nonzero_and_reads_nothing_back(kernels, monkeypatch):
    """The loss equals the ``nonzero`` path's exactly, and with sync debug mode set to "error" the
    whole forward and backward run: the count's event wait is no stream synchronisation (it does
    not trip the mode), and nothing else reads back from the device. No attention mask: deciding
    whether anything is padded reads one bool back (:func:`key_padding_mask_of`)."""
    model = _cuda_model(kernels)
    batches = [_batch(seed=7, p_label=0.15, device="cuda"), _batch(seed=8, p_label=0.5, device="cuda")]
    _step(model, *batches[0])  # Triton compiles and autotunes (and synchronises) on first use
    counts = _spy_counts(monkeypatch)
    for batch in batches:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss, grads = _step(model, *batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        plain_loss, plain_grads = _plain_step(model, *batch)
        assert torch.equal(loss, plain_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    want = [int((labels != -100).sum()) for _, _, labels, _ in batches]
    assert counts == [want[0], None, want[1], None]  # each forward its own count; the plain path none


@pytest.mark.gpu
def test_cuda_count_path_through_graphed_layers():
    """With the encoder replayed from CUDA graphs the count stays outside the captures, and the
    replayed steps read nothing back either."""
    model = _cuda_model("dslab")
    model.enable_cuda_graphs()
    eager = _cuda_model("dslab")
    batch = _batch(seed=9, device="cuda")
    for _ in range(2):  # the first call captures, the second replays
        loss, grads = _step(model, *batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, grads = _step(model, *batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert model.cuda_graph_stats["replays"] >= 2, model.cuda_graph_stats
    plain_loss, plain_grads = _plain_step(eager, *batch)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_no_count_is_prepared_inside_a_capture_or_for_dense_mlm():
    model = _cuda_model("torch")
    _, _, labels, _ = _batch(seed=10, device="cuda")
    assert isinstance(model.label_count_ahead(labels), LabelCount)
    assert _cuda_model("torch", sparse_mlm=False).label_count_ahead(labels) is None
    scratch = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scratch.add_(1)
        assert model.label_count_ahead(labels) is None

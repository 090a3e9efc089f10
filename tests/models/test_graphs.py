"""CUDA graphs over the layer stack (dslab.models.graphs): where they may not run, the stack runs
eagerly and says why; on a GPU, graphed training matches eager training step for step."""

import copy

import pytest
import torch

from dslab.models import BertForPreTraining, GPT2LMHeadModel, bert_tiny, gpt2_tiny
from dslab.models.graphs import LayerStackGraphs, SegmentedLayerGraphs


def gpt2_batch(device, batch=3, seq=40, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, 1000, (batch, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def test_off_cuda_the_stack_runs_eagerly_and_counts_why():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(), kernels="torch")
    reference = GPT2LMHeadModel(gpt2_tiny(), kernels="torch")
    reference.load_state_dict(model.state_dict())
    model.enable_cuda_graphs()
    batch = gpt2_batch("cpu")
    model.eval(), reference.eval()
    torch.testing.assert_close(model(**batch), reference(**batch), rtol=0, atol=0)
    model.train()
    model(**batch).backward()
    assert model.cuda_graph_stats == {"eager_eval": 1, "eager_not_cuda": 1}
    model.enable_cuda_graphs(False)
    assert model.cuda_graph_stats == {}


def test_stack_refuses_a_non_modulelist():
    with pytest.raises(ValueError, match="ModuleList"):
        LayerStackGraphs(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="max_signatures"):
        LayerStackGraphs(torch.nn.ModuleList(), max_signatures=0)


def test_segments_cut_the_stack_into_consecutive_runs_and_run_it_as_one():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(layers=5, dropout=0.0), kernels="torch")
    reference = GPT2LMHeadModel(gpt2_tiny(layers=5, dropout=0.0), kernels="torch")
    reference.load_state_dict(model.state_dict())
    model.enable_cuda_graphs(segments=3)
    graphs = model._layer_graphs
    runs = [list(segment.layers) for segment in graphs.segments]
    assert [len(r) for r in runs] == [2, 1, 2] and sum(runs, []) == list(model.layers)
    assert len(SegmentedLayerGraphs(model.layers, 9).segments) == 5  # at most one per layer
    batch = gpt2_batch("cpu")
    loss, want = model(**batch), reference(**batch)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    loss.backward(), want.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    # off CUDA each segment ran eagerly and says so: one count per segment
    assert model.cuda_graph_stats == {"eager_not_cuda": 3}
    with pytest.raises(ValueError, match="segments"):
        SegmentedLayerGraphs(model.layers, 0)
    model.enable_cuda_graphs(False)
    assert model.cuda_graph_stats == {}


# ----------------------------------------------------------------------------------------- GPU --

cuda = pytest.mark.gpu


def _pair(kernels, dropout, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = gpt2_tiny(dropout=dropout)
    graphed = GPT2LMHeadModel(cfg, kernels=kernels).cuda()
    eager = GPT2LMHeadModel(cfg, kernels=kernels).cuda()
    eager.load_state_dict(graphed.state_dict())
    graphed.enable_cuda_graphs()
    return graphed, eager


def _train(model, steps, autocast_dtype, accumulate=1, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            batch = gpt2_batch("cuda", seed=seed + step * accumulate + micro)
            with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(**batch)
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@cuda
@pytest.mark.parametrize("kernels", ["dslab", "torch"])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_graphed_training_matches_eager(kernels, autocast_dtype):
    graphed, eager = _pair(kernels, dropout=0.0)
    got = _train(graphed, 4, autocast_dtype)
    want = _train(eager, 4, autocast_dtype)
    tol = 1e-4 if autocast_dtype is None else 2e-2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tol, atol=tol)
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)
    stats = graphed.cuda_graph_stats
    assert stats["captures"] == 1 and stats["replays"] == 4, stats


@cuda
def test_segmented_graphs_train_as_one_graph_does():
    torch.manual_seed(0)
    cfg = gpt2_tiny(dropout=0.0)
    whole = GPT2LMHeadModel(cfg, kernels="dslab").cuda()
    cut = GPT2LMHeadModel(cfg, kernels="dslab").cuda()
    cut.load_state_dict(whole.state_dict())
    whole.enable_cuda_graphs()
    cut.enable_cuda_graphs(segments=2)
    got = _train(cut, 4, torch.bfloat16)
    want = _train(whole, 4, torch.bfloat16)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-3)
    for (name, p), q in zip(cut.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-3, msg=name)
    stats = cut.cuda_graph_stats
    assert stats["captures"] == 2 and stats["replays"] == 8, stats


_STREAM_CHECK = """
import torch
from dslab.models import GPT2LMHeadModel, gpt2_tiny
torch.manual_seed(0)
model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab").cuda()
model.enable_cuda_graphs()
ids = torch.randint(0, 1000, (3, 40), device="cuda")
for _ in range(3):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids)
    loss.backward()
    model.zero_grad(set_to_none=True)
torch.cuda.synchronize()
assert model.cuda_graph_stats["replays"] == 3, model.cuda_graph_stats
"""


@cuda
def test_replayed_gradients_accumulate_on_the_default_stream():
    """The capture's side stream must not stay attached to the parameters' AccumulateGrad nodes:
    torch warns (once per process, so in a fresh one) when later accumulations cross streams."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-W", "always", "-c", _STREAM_CHECK],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AccumulateGrad node's stream does not match" not in proc.stderr, proc.stderr[-3000:]


@cuda
def test_gradient_accumulation_is_exact_under_graphs():
    graphed, eager = _pair("dslab", dropout=0.0)
    got = _train(graphed, 2, None, accumulate=3)
    want = _train(eager, 2, None, accumulate=3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
    for p, q in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)


@cuda
def test_dropout_draws_new_masks_on_every_replay():
    graphed, _ = _pair("dslab", dropout=0.3)
    batch = gpt2_batch("cuda")
    losses = []
    for _ in range(3):
        loss = graphed(**batch)
        loss.backward()
        losses.append(float(loss.detach()))
    assert graphed.cuda_graph_stats["replays"] == 3
    assert len(set(losses)) == 3, losses


@cuda
def test_moved_parameters_are_captured_again_and_hooks_run_eagerly():
    graphed, eager = _pair("dslab", dropout=0.0)
    _train(graphed, 1, None)
    for p in graphed.parameters():
        p.data = p.data.clone()
    _train(graphed, 1, None)
    assert graphed.cuda_graph_stats["captures"] == 2
    calls = []
    handle = graphed.layers[0].register_forward_hook(lambda *a: calls.append(1))
    _train(graphed, 1, None)
    handle.remove()
    assert calls == [1] and graphed.cuda_graph_stats["eager_hooks"] == 1


@cuda
def test_bert_with_padding_mask_matches_eager():
    torch.manual_seed(0)
    cfg = bert_tiny(hidden_dropout=0.0, attention_dropout=0.0)
    graphed = BertForPreTraining(cfg).cuda()
    eager = BertForPreTraining(cfg).cuda()
    eager.load_state_dict(graphed.state_dict())
    graphed.enable_cuda_graphs()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    labels = torch.where(torch.rand(ids.shape, device="cuda") < 0.3, ids, torch.full_like(ids, -100))
    nsp = torch.tensor([0, 1], device="cuda")
    for model in (graphed, eager):
        for _ in range(2):
            loss = model(ids, attention_mask=mask, masked_lm_labels=labels, next_sentence_label=nsp)
            loss.backward()
    torch.testing.assert_close(graphed.embeddings.word_embeddings.weight.grad,
                               eager.embeddings.word_embeddings.weight.grad, rtol=1e-4, atol=1e-5)
    assert graphed.cuda_graph_stats["replays"] == 2


def test_stand_ins_take_the_parameters_place_and_gradients():
    """The capture's stand-ins (dslab.models.graphs.stand_ins): leaves sharing each trainable
    parameter's storage (a tied one once, under both names), swapped in for the modules'
    parameters they give the parameters' outputs and gradients, and the autograd graph of a stack
    run with them reaches none of the parameters' AccumulateGrad nodes, so a graph of an earlier
    eager step that still holds those nodes cannot reach the capture."""
    from torch.nn.utils.stateless import _reparametrize_module

    from dslab.models.graphs import leaves_reached, stand_ins
    from dslab.models.weight_cast import use_casts, weight

    torch.manual_seed(0)
    stack = GPT2LMHeadModel(gpt2_tiny(layers=2, dropout=0.0), kernels="torch").layers
    stack[1].mlp.fc_in.weight = stack[0].mlp.fc_in.weight  # tied across layers
    stack[0].attention_norm.bias.requires_grad_(False)
    params = [p for p in stack.parameters() if p.requires_grad]
    x = torch.randn(2, 7, stack[0].mlp_norm.weight.numel(), requires_grad=True)

    def run(xs):
        for layer in stack:
            xs = layer(xs)
        return xs

    stale = run(x).square().sum()  # an eager step's graph, kept alive
    stale.backward(retain_graph=True)
    assert len(leaves_reached([stale], params)) == len(params)
    want = torch.autograd.grad(run(x).square().sum(), params)

    leaves, mapping = stand_ins(stack)
    assert len(leaves) == len(params)
    for p, leaf in zip(params, leaves):
        assert leaf is not p and leaf.is_leaf and leaf.requires_grad and leaf.data_ptr() == p.data_ptr()
    assert mapping["0.mlp.fc_in.weight"] is mapping["1.mlp.fc_in.weight"]
    assert "0.attention_norm.bias" not in mapping
    with _reparametrize_module(stack, mapping):
        out = run(x).square().sum()
    assert isinstance(stack[0].mlp.fc_in.weight, torch.nn.Parameter)  # put back
    assert leaves_reached([out], params) == []
    assert len(leaves_reached([out], leaves)) == len(leaves)
    got = torch.autograd.grad(out, leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)

    # inside a copies scope the stand-in shares the copy's storage, not the parameter's
    first = params[0]
    copy = first.detach().to(torch.float64).requires_grad_()
    with use_casts({id(first): copy}):
        assert weight(first) is copy
        leaves, _ = stand_ins(stack)
    assert leaves[0].dtype == torch.float64 and leaves[0].data_ptr() == copy.data_ptr()


def _closure_stack():
    """Two linears whose run reads the second's weight from a list taken at construction, not
    through its module's attribute: stand-ins cannot reach that read."""
    torch.manual_seed(3)
    modules = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 16, bias=False)])
    held = [modules[1].weight]

    def run(x):
        return (torch.tanh(torch.nn.functional.linear(modules[0](x), held[0])),)

    return modules, run


def test_a_parameter_read_outside_its_module_attribute_is_detected():
    """The first warm-up's check (dslab.models.graphs): run with stand-ins swapped in, the graph
    still reaches the parameter read from the closure, and only that one; the capture then keeps
    the parameters (counted as ``captures_on_parameters``, GPU test below)."""
    from torch.nn.utils.stateless import _reparametrize_module

    from dslab.models.graphs import leaves_reached, stand_ins

    modules, run = _closure_stack()
    params = [p for p in modules.parameters() if p.requires_grad]
    _, mapping = stand_ins(modules)
    with _reparametrize_module(modules, mapping):
        (out,) = run(torch.randn(3, 16))
    assert leaves_reached([out], params) == [modules[1].weight]


@cuda
def test_a_stack_reading_a_parameter_outside_its_attribute_captures_on_the_parameters():
    from dslab.models.graphs import GraphedStack

    modules, run = _closure_stack()
    modules.cuda()
    eager_modules = copy.deepcopy(modules)
    graphed = GraphedStack(modules, run)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(5, 16, generator=g).cuda()
        graphed.call((x,))[0].square().sum().backward()
        torch.nn.functional.linear(eager_modules[0](x), eager_modules[1].weight).tanh().square().sum().backward()
    for (name, p), q in zip(modules.named_parameters(), eager_modules.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert graphed.stats["captures"] == 1 and graphed.stats["captures_on_parameters"] == 1, graphed.stats

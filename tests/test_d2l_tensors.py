"""d2l's tensor names and plotting helpers, with the attention chapters' inputs.

The names and signatures are both books' (d2l-zh 2.0 and d2l 1.0.3 ``d2l/torch.py``);
the values are checked against torch's own functions drawing from the same seed, and
against float64 or numpy computations of what the chapters compute with them. The
pictures are checked on matplotlib's objects: grid, images, colour bar, labels, lines.
"""

import inspect
import math

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib import pyplot as plt

from qkv import d2l
from qkv.d2l import plotting, tensors
from qkv.utils.figures import heatmap_grid, new_figure

# Both books' alias lists (d2l/torch.py, "Alias defined in config.ini"): the names are
# facts of the books; d2l 1.0.3 adds ones_like, zeros_like, int64, sigmoid, batch_matmul,
# expand_dims, swapaxes, repeat to d2l-zh's.
BOOK_ALIASES = [
    "nn_Module", "ones", "zeros", "tensor", "arange", "meshgrid", "sin", "sinh", "cos", "cosh",
    "tanh", "linspace", "exp", "log", "normal", "rand", "randn", "matmul", "int32",
    "float32", "concat", "stack", "abs", "eye", "numpy", "size", "reshape", "to",
    "reduce_sum", "argmax", "astype", "transpose", "reduce_mean",
    "ones_like", "zeros_like", "int64", "sigmoid", "batch_matmul", "expand_dims",
    "swapaxes", "repeat",
]
BOOK_HELPERS = ["check_shape", "check_len", "plot", "set_axes", "set_figsize",
                "use_svg_display", "show_heatmaps", "Animator", "Timer", "Accumulator"]


@pytest.fixture(autouse=True)
def headless(tmp_path, monkeypatch):
    """Each test in its own folder, as on a machine with no display, its figures closed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(d2l.plt, "get_backend", lambda: "agg")
    monkeypatch.setattr(plotting, "_saved", type(plotting._saved)())
    monkeypatch.setattr(plotting, "_last_saved", {})
    with matplotlib.rc_context():
        yield
    plt.close("all")


# ----------------------------------------------------------------------------
# Names


@pytest.mark.parametrize("name", BOOK_ALIASES + BOOK_HELPERS)
def test_every_book_name_is_there_and_exported(name):
    assert name in d2l.__all__
    assert callable(getattr(d2l, name)) or isinstance(getattr(d2l, name), torch.dtype)
    assert name in dir(d2l)


def test_star_import_and_from_import_give_the_aliases():
    ns = {}
    exec("from qkv.d2l import *", ns)
    assert ns["concat"] is torch.cat and ns["reshape"] is tensors.reshape
    from qkv.d2l import abs as d2l_abs  # noqa: F401  (the import itself is the check)

    assert d2l_abs is torch.abs


def test_the_aliases_do_not_shadow_builtins_in_qkv_d2l_itself():
    # d2l.abs is torch.abs, but code in qkv/d2l/__init__.py still sees Python's abs.
    assert "abs" not in vars(d2l) and "size" not in vars(d2l)
    with pytest.raises(AttributeError, match="no attribute 'not_a_d2l_name'"):
        d2l.not_a_d2l_name  # noqa: B018


def test_torch_names_and_dtypes_are_torchs():
    pairs = {"ones": torch.ones, "zeros": torch.zeros, "tensor": torch.tensor,
             "arange": torch.arange, "concat": torch.cat, "batch_matmul": torch.bmm,
             "normal": torch.normal, "rand": torch.rand, "randn": torch.randn,
             "int32": torch.int32, "int64": torch.int64, "float32": torch.float32,
             "nn_Module": torch.nn.Module}
    for name, obj in pairs.items():
        assert getattr(d2l, name) is obj, name


# ----------------------------------------------------------------------------
# Values, on the chapters' inputs


@pytest.mark.parametrize(
    "name, reference, args, kwargs",
    [
        ("ones", torch.ones, ((2, 1, 4),), {}),
        ("ones", torch.ones, ((2, 100),), {"dtype": torch.long}),
        ("zeros", torch.zeros, ((4, 7),), {"dtype": torch.long}),
        ("zeros", torch.zeros, ((1, 60, 32),), {}),
        ("tensor", torch.tensor, ([[1, 2], [2, 3]],), {"dtype": torch.float32}),
        ("tensor", torch.tensor, ([3, 2],), {}),
        ("arange", torch.arange, (0, 5, 0.1), {}),
        ("arange", torch.arange, (20.0,), {}),
        ("arange", torch.arange, (-2.5, 2.5, 0.1), {}),
        ("arange", torch.arange, (60,), {"dtype": torch.float32}),
        ("eye", torch.eye, (10,), {}),
        ("linspace", torch.linspace, (0, 1, 5), {}),
        ("normal", torch.normal, (0, 1, (2, 1, 20)), {}),
        ("normal", torch.normal, (0.0, 0.5, (50,)), {}),
        ("rand", torch.rand, (50,), {}),
        ("randn", torch.randn, (50,), {}),
    ],
)
def test_creation_aliases_equal_torch_from_the_same_seed(name, reference, args, kwargs):
    torch.manual_seed(0)
    out, after = getattr(d2l, name)(*args, **kwargs), torch.rand(3)
    torch.manual_seed(0)
    expected, expected_after = reference(*args, **kwargs), torch.rand(3)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert torch.equal(after, expected_after)  # the generator is left where torch leaves it


def test_elementwise_aliases_on_the_kernels_inputs():
    x = d2l.arange(-2.5, 2.5, 0.1)
    x64 = np.arange(-2.5, 2.5, 0.1)[: len(x)]
    for name, fn in [("sin", np.sin), ("cos", np.cos), ("exp", np.exp), ("abs", np.abs),
                     ("tanh", np.tanh), ("sinh", np.sinh), ("cosh", np.cosh)]:
        np.testing.assert_allclose(getattr(d2l, name)(x).numpy(), fn(x64), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    np.testing.assert_allclose(d2l.log(d2l.exp(x)).numpy(), x64, atol=1e-5)
    np.testing.assert_allclose(d2l.sigmoid(x).numpy(), 1 / (1 + np.exp(-x64)), rtol=1e-5)


def test_attention_pooling_weights_from_the_aliases_match_a_float64_loop():
    # d2l.arange, reshape, exp, ones, matmul: the Nadaraya-Watson demo of d2l-zh 10.2
    weights = d2l.ones((2, 10)) * 0.1
    values = d2l.reshape(d2l.arange(20.0), (2, 10))
    out = torch.bmm(weights.unsqueeze(1), values.unsqueeze(-1))
    assert out.tolist() == [[[4.5]], [[14.5]]]  # the mean of 0..9 and of 10..19
    X, Y = d2l.ones((2, 1, 4)), d2l.ones((2, 4, 6))
    assert torch.bmm(X, Y).shape == (2, 1, 6)

    # d2l 1.0.3 11.2's nadaraya_watson, written with the aliases as the chapter does
    torch.manual_seed(0)
    x_train, _ = torch.sort(d2l.rand(10) * 5)
    y_train = 2 * d2l.sin(x_train) + x_train + d2l.randn(10)
    x_val = d2l.arange(0, 5, 0.1)
    dists = d2l.reshape(x_train, (-1, 1)) - d2l.reshape(x_val, (1, -1))
    k = d2l.astype(d2l.exp(-dists**2 / 2), d2l.float32)
    attention_w = k / d2l.reduce_sum(k, 0)
    y_hat = d2l.transpose(d2l.transpose(y_train) @ attention_w)
    for j, v in enumerate(x_val.tolist()):
        kern = [math.exp(-((xi - v) ** 2) / 2) for xi in x_train.tolist()]
        expected = sum(kv * yi for kv, yi in zip(kern, y_train.tolist(), strict=True))
        assert math.isclose(float(y_hat[j]), expected / sum(kern), rel_tol=1e-5)


def test_leave_one_out_keys_of_the_trained_kernel():
    # d2l-zh 10.2.4: the training keys of each query are all other training inputs
    n_train = 5
    x_train = d2l.arange(n_train, dtype=d2l.float32)
    X_tile = x_train.repeat((n_train, 1))
    keys = d2l.reshape(X_tile[(1 - d2l.eye(n_train)).type(torch.bool)], (n_train, -1))
    assert keys.tolist() == [[float(j) for j in range(n_train) if j != i]
                             for i in range(n_train)]


def test_method_aliases_equal_the_tensor_methods_and_numpy():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    a = x.detach().numpy().astype(np.float64)
    out = d2l.numpy(x)
    assert isinstance(out, np.ndarray) and np.array_equal(out, x.detach().numpy())
    assert d2l.size(x) == 12
    assert d2l.reshape(x, (2, 6)).shape == (2, 6) and d2l.reshape(x, 4, 3).shape == (4, 3)
    assert d2l.to(x, torch.float64).dtype == torch.float64
    np.testing.assert_allclose(d2l.reduce_sum(x, 0).detach().numpy(), a.sum(0), rtol=1e-6)
    np.testing.assert_allclose(float(d2l.reduce_sum(x.detach())), a.sum(), rtol=1e-5)
    np.testing.assert_allclose(d2l.reduce_mean(x, 1).detach().numpy(), a.mean(1), rtol=1e-6)
    assert d2l.argmax(x, axis=1).tolist() == a.argmax(1).tolist()
    assert d2l.astype(x, torch.int32).dtype == torch.int32
    assert np.array_equal(d2l.numpy(d2l.transpose(x)), a.T.astype(np.float32))
    with pytest.raises(RuntimeError):  # x.t(), as in d2l: 2-D at most
        d2l.transpose(torch.ones(2, 3, 4))
    assert d2l.expand_dims(x, 0).shape == (1, 3, 4)
    assert np.array_equal(d2l.numpy(d2l.swapaxes(x, 0, 1)), a.T.astype(np.float32))
    assert np.array_equal(d2l.numpy(d2l.repeat(x, 2, 1)), np.tile(a, (2, 1)).astype(np.float32))
    pieces = [torch.ones(1, 2), torch.zeros(1, 2)]
    assert d2l.concat(pieces, 0).tolist() == [[1, 1], [0, 0]]
    assert d2l.stack(pieces).shape == (2, 1, 2)


def test_check_shape_and_check_len_raise_d2ls_message_as_assertion_and_value_error():
    d2l.check_shape(torch.bmm(d2l.ones((2, 3, 4)), d2l.ones((2, 4, 6))), (2, 3, 6))
    d2l.check_shape(torch.ones(2, 3), [2, 3])
    d2l.check_shape(torch.ones(2, 3), torch.Size([2, 3]))
    d2l.check_len([1, 2, 3], 3)
    with pytest.raises(AssertionError) as caught:
        d2l.check_shape(torch.ones(2, 1, 4), (2, 4, 1))
    assert isinstance(caught.value, ValueError)
    assert str(caught.value) == (
        "tensor's shape torch.Size([2, 1, 4]) != expected shape (2, 4, 1)")
    with pytest.raises(ValueError, match=r"^list's length 2 != expected length 3$"):
        d2l.check_len([1, 2], 3)


# ----------------------------------------------------------------------------
# Signatures: both books'


def params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


E = inspect.Parameter.empty
FMTS = ("-", "m--", "g-.", "r:")


def test_plotting_signatures_are_the_books():
    assert params(d2l.show_heatmaps) == [
        ("matrices", E), ("xlabel", E), ("ylabel", E), ("titles", None),
        ("figsize", (2.5, 2.5)), ("cmap", "Reds")]
    assert params(d2l.plot) == [
        ("X", E), ("Y", None), ("xlabel", None), ("ylabel", None), ("legend", None),
        ("xlim", None), ("ylim", None), ("xscale", "linear"), ("yscale", "linear"),
        ("fmts", FMTS), ("figsize", (3.5, 2.5)), ("axes", None)]
    assert params(d2l.set_axes) == [(n, E) for n in (
        "axes", "xlabel", "ylabel", "xlim", "ylim", "xscale", "yscale", "legend")]
    assert params(d2l.set_figsize) == [("figsize", (3.5, 2.5))]
    assert params(d2l.use_svg_display) == []


def test_animator_timer_accumulator_signatures_are_the_books():
    assert params(d2l.Animator) == [
        ("xlabel", None), ("ylabel", None), ("legend", None), ("xlim", None), ("ylim", None),
        ("xscale", "linear"), ("yscale", "linear"), ("fmts", FMTS), ("nrows", 1),
        ("ncols", 1), ("figsize", (3.5, 2.5))]
    assert params(d2l.Timer) == []
    assert params(d2l.Accumulator) == [("n", E)]
    for method in ("start", "stop", "avg", "sum", "cumsum"):
        assert params(getattr(d2l.Timer, method)) == [("self", E)]
    assert params(d2l.Accumulator.add)[1][0] == "args"
    assert hasattr(d2l.Accumulator, "reset") and hasattr(d2l.Accumulator, "__getitem__")


# ----------------------------------------------------------------------------
# show_heatmaps


def image_axes(fig):
    return [ax for ax in fig.axes if ax.images]


def grid_position(ax):
    spec = ax.get_subplotspec()
    return spec.rowspan.start, spec.colspan.start


def test_show_heatmaps_of_the_identity_draws_the_books_picture(tmp_path):
    before = plt.get_fignums()
    d2l.show_heatmaps(d2l.reshape(d2l.eye(10), (1, 1, 10, 10)), xlabel="Keys",
                      ylabel="Queries")
    [num] = sorted(set(plt.get_fignums()) - set(before))
    fig = plt.figure(num)
    assert tuple(fig.get_size_inches()) == (2.5, 2.5)
    [ax] = image_axes(fig)
    [image] = ax.images
    assert np.array_equal(np.asarray(image.get_array()), np.eye(10))
    assert image.get_cmap().name.startswith("Reds")
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("Keys", "Queries", "")
    colorbars = [a for a in fig.axes if a is not ax]
    assert len(colorbars) == 1 and image.colorbar is not None
    assert (image.norm.vmin, image.norm.vmax) == (0.0, 1.0)
    # no display: saved, cropped, in the working directory
    assert (tmp_path / "heatmaps_1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_heatmaps_of_heads_is_a_grid_with_one_colour_bar_and_titles():
    torch.manual_seed(0)
    weights = torch.softmax(torch.randn(2, 4, 6, 6, requires_grad=True), -1)  # needs grad
    titles = [f"Head {i}" for i in range(1, 5)]
    d2l.show_heatmaps(weights, xlabel="Key positions", ylabel="Query positions",
                      titles=titles, figsize=(7, 3.5))
    fig = plt.gcf()
    assert tuple(fig.get_size_inches()) == (7, 3.5)
    panels = image_axes(fig)
    assert sorted(grid_position(ax) for ax in panels) == [(i, j) for i in range(2)
                                                          for j in range(4)]
    w = weights.detach().double().numpy()
    colorbars = {id(im.colorbar) for ax in panels for im in ax.images if im.colorbar}
    assert len(fig.axes) == 9 and len(colorbars) == 1  # 8 panels, one colour bar
    for ax in panels:
        i, j = grid_position(ax)
        [image] = ax.images
        np.testing.assert_allclose(np.asarray(image.get_array()), w[i, j])
        # one scale for all, from 0 (weights are non-negative) to the largest weight
        assert (image.norm.vmin, image.norm.vmax) == (0.0, pytest.approx(w.max()))
        assert ax.get_title() == titles[j]
        assert ax.get_xlabel() == ("Key positions" if i == 1 else "")
        assert ax.get_ylabel() == ("Query positions" if j == 0 else "")
    assert {ax.get_shared_x_axes().joined(panels[0], ax) for ax in panels} == {True}


def test_show_heatmaps_takes_the_colour_map_and_draws_masked_cells_grey():
    P = torch.sin(torch.arange(60.0)[:, None] / torch.arange(1.0, 33.0))  # in [-1, 1]
    d2l.show_heatmaps(P[None, None], xlabel="Column (encoding dimension)",
                      ylabel="Row (position)", figsize=(3.5, 4), cmap="Blues")
    [ax] = image_axes(plt.gcf())
    assert ax.images[0].get_cmap().name.startswith("Blues")
    np.testing.assert_allclose(ax.images[0].norm.vmin, float(P.min()))
    fig = new_figure(3, 3)
    scores = torch.tensor([[[[0.5, -math.inf], [0.25, 0.75]]]])
    [[ax]] = heatmap_grid(fig, scores)
    image = ax.images[0]
    assert np.ma.getmaskarray(image.get_array()).tolist() == [[False, True], [False, False]]
    assert (image.norm.vmin, image.norm.vmax) == (0.0, 0.75)
    assert image.cmap.get_bad()[:3] == pytest.approx((0.85, 0.85, 0.85))


def test_show_heatmaps_refuses_bad_input_in_one_line_and_leaves_no_figure():
    before = plt.get_fignums()
    with pytest.raises(ValueError, match=r"^matrices must be a 4-D .* got shape \(10, 10\)$"):
        d2l.show_heatmaps(torch.eye(10), "k", "q")
    with pytest.raises(ValueError, match=r"^titles has 1 entries for 4 columns of matrices$"):
        d2l.show_heatmaps(torch.ones(1, 4, 2, 2), "k", "q", titles=["Head 1"])
    assert plt.get_fignums() == before


def test_pictures_are_not_saved_where_they_can_be_shown(tmp_path, monkeypatch):
    monkeypatch.setattr(d2l.plt, "get_backend", lambda: "QtAgg")
    d2l.show_heatmaps(torch.ones(1, 1, 2, 2), "k", "q")
    d2l.plot(torch.arange(3.0))
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------
# plot, set_axes, set_figsize


def test_plot_of_positional_encodings_draws_four_styled_lines_with_legend(tmp_path):
    # d2l 11.6.3: columns 6 to 9 of the sinusoidal encoding against the position
    num_steps = 60
    pos = torch.arange(num_steps, dtype=torch.float64)[:, None]
    P = torch.cat([torch.sin(pos / 10000 ** (torch.arange(0, 32, 2) / 32)),
                   torch.cos(pos / 10000 ** (torch.arange(0, 32, 2) / 32))], 1)
    cols = P[:, 6:10].float()
    d2l.plot(d2l.arange(num_steps), cols.T, xlabel="Row (position)", figsize=(6, 2.5),
             legend=[f"Col {int(d)}" for d in d2l.arange(6, 10)])
    fig, ax = plt.gcf(), plt.gca()
    assert tuple(fig.get_size_inches()) == (6, 2.5)
    lines = ax.get_lines()
    assert len(lines) == 4
    styles = [(line.get_linestyle(), matplotlib.colors.to_hex(line.get_color()))
              for line in lines]
    assert styles[1:] == [("--", "#bf00bf"), ("-.", "#008000"), (":", "#ff0000")]
    assert styles[0][0] == "-"
    for k, line in enumerate(lines):
        assert np.array_equal(line.get_xdata(), np.arange(num_steps))
        np.testing.assert_allclose(line.get_ydata(), cols[:, k].numpy())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "Col 6", "Col 7", "Col 8", "Col 9"]
    assert ax.get_xlabel() == "Row (position)" and ax.get_ylabel() == ""
    assert all(line.get_visible() for line in ax.get_xgridlines())
    assert (tmp_path / "plot_1.png").stat().st_size > 0


def test_plot_of_kernel_regression_keeps_what_the_caller_adds_in_the_file(tmp_path):
    # d2l-zh 10.2's plot_kernel_reg: truth and prediction, then the training points
    x_test = d2l.arange(0, 5, 0.1)
    y_truth = 2 * d2l.sin(x_test) + x_test**0.8
    y_hat = torch.full_like(x_test, 2.0, requires_grad=True) * 1  # a tensor with grad
    d2l.plot(x_test, [y_truth, y_hat], "x", "y", legend=["Truth", "Pred"], xlim=[0, 5],
             ylim=[-1, 5])
    ax = plt.gca()
    assert [line.get_linestyle() for line in ax.get_lines()] == ["-", "--"]
    np.testing.assert_allclose(ax.get_lines()[1].get_ydata(), 2.0)
    assert (ax.get_xlim(), ax.get_ylim()) == ((0, 5), (-1, 5))
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("x", "y")
    first = (tmp_path / "plot_1.png").read_bytes()
    d2l.plt.plot([1.0, 2.0], [1.0, 2.0], "o", alpha=0.5)
    # the next picture begins: plot_1.png gets the points the caller added
    d2l.plot(x_test, [y_truth, y_hat], "x", "y", legend=["Truth", "Pred"])
    assert (tmp_path / "plot_1.png").read_bytes() != first
    again = (tmp_path / "plot_2.png").read_bytes()
    d2l.show_heatmaps(torch.ones(1, 1, 2, 2), "k", "q")
    assert (tmp_path / "plot_2.png").read_bytes() == again  # nothing added: same picture
    assert len(plt.gca().get_lines()) == 0  # the heatmap is the current figure now


def test_plot_of_one_series_draws_it_against_its_indices_on_given_axes():
    fig, axes = plt.subplots(1, 2)
    plt.sca(axes[0])
    d2l.plot([3.0, 1.0, 2.0], axes=axes[1], xscale="linear", yscale="log")
    [line] = axes[1].get_lines()
    assert line.get_xdata().tolist() == [0, 1, 2] and line.get_ydata().tolist() == [3, 1, 2]
    assert axes[1].get_yscale() == "log" and axes[1].get_legend() is None
    assert axes[0].get_lines() == [] and plt.gca() is axes[0]


def test_set_figsize_sets_the_size_of_the_next_figure():
    d2l.set_figsize((4.5, 2.0))
    assert tuple(plt.figure().get_size_inches()) == (4.5, 2.0)


def test_set_axes_labels_scales_limits_and_legend():
    fig, ax = plt.subplots()
    ax.plot([1, 10], [1, 100])
    d2l.set_axes(ax, "epoch", "loss", [1, 10], None, "log", "linear", ["train"])
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("epoch", "loss")
    assert (ax.get_xscale(), ax.get_yscale(), ax.get_xlim()) == ("log", "linear", (1, 10))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train"]


def test_animator_draws_on_its_first_panel_as_points_come():
    # d2l-zh 10.2.4's loop: a number per epoch; d2l 1.0.3 passes tensors too
    animator = d2l.Animator(xlabel="epoch", ylabel="loss", xlim=[1, 5])
    for epoch, loss in enumerate([43.67, 19.09, 19.08], start=1):
        animator.add(epoch + 0, loss)
    [ax] = animator.axes
    [line] = ax.get_lines()
    assert line.get_xdata().tolist() == [1, 2, 3] and line.get_ydata().tolist() == [
        43.67, 19.09, 19.08]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_xlim()) == ("epoch", "loss", (1, 5))
    two = d2l.Animator(legend=["train", "test"], nrows=2, ncols=2, figsize=(5, 5))
    assert len(two.axes) == 4 and tuple(two.fig.get_size_inches()) == (5, 5)
    two.add(1, torch.tensor([0.5, 0.75]))
    two.add(torch.tensor(2), (0.4, None))  # None: no point on that line
    lines = two.axes[0].get_lines()
    assert [line.get_ydata().tolist() for line in lines] == [[0.5, 0.4], [0.75]]
    assert [t.get_text() for t in two.axes[0].get_legend().get_texts()] == ["train", "test"]
    assert all(not ax.get_lines() for ax in two.axes[1:])

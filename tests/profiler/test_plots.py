"""The plots people read: the R->P figure of a shipped profile and the Gantt chart of a shipped
schedule, checked through matplotlib's object API on the Agg backend."""


import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from repo import ROOT  # noqa: E402

from nanosched.profiler.format import load_profile  # noqa: E402
from nanosched.profiler.show import DIAGONAL_LABEL, profile_figure  # noqa: E402
from nanosched.schedules.format import load_schedule  # noqa: E402
from nanosched.schedules.show import gantt_figure  # noqa: E402

PROFILES = ROOT / "nanosched" / "profiler" / "profiles"
SHIPPED_SCHEDULE = ROOT / "tests" / "data" / "llama3-8b-tp1-h200-b2048-single.json"


def _axes_titled(fig, prefix):
    return [ax for ax in fig.axes if ax.get_title().startswith(prefix)]


@pytest.mark.parametrize("name", ["llama3-8b-tp1-h100", "llama3-70b-tp2-h200x2-quick"])
def test_rp_plot_has_one_scatter_per_mechanism_and_the_diagonal(name):
    prof = load_profile(PROFILES / f"{name}.json")
    fig = profile_figure(prof)
    try:
        classes = sorted({p.other_class for p in prof.pairs})
        assert classes
        for cls in classes:
            mechanisms = {p.mechanism for p in prof.pairs if p.other_class == cls}
            (ax_p,) = _axes_titled(fig, f"P_compute vs P_{cls}")
            scatters = [c for c in ax_p.collections if isinstance(c, PathCollection)]
            labels = [c.get_label() for c in scatters]
            assert sorted(lab for lab in labels if lab in mechanisms) == sorted(mechanisms)
            assert len(set(labels)) == len(labels)
            # each mechanism's scatter holds exactly its pairs
            for c in scatters:
                if c.get_label() in mechanisms:
                    n = sum(1 for p in prof.pairs
                            if p.other_class == cls and p.mechanism == c.get_label())
                    assert len(c.get_offsets()) == n
            (diag,) = [ln for ln in ax_p.lines if ln.get_label() == DIAGONAL_LABEL]
            x, y = diag.get_data()
            assert list(x) == [0, 1] and list(y) == [1, 0]
            # the R panel has points only: no line drawn through them
            (ax_r,) = _axes_titled(fig, f"R->P, {cls}")
            assert len(ax_r.lines) == 0
            assert len([c for c in ax_r.collections if isinstance(c, PathCollection)]) == \
                2 * len(mechanisms)
    finally:
        plt.close(fig)


def test_gantt_labels_fit_their_bars_and_never_overlap():
    s = load_schedule(SHIPPED_SCHEDULE)
    fig = gantt_figure(s)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        labels = [t for t in ax.texts if t.get_text()]
        assert len(labels) >= 5
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), "two Gantt labels overlap"
        ids = {n.id: n for n in s.nano_ops}
        lanes = [st.name for st in s.streams]
        for t, box in zip(labels, boxes, strict=True):
            n = ids[t.get_text().replace("\n", " ").split(" ")[0]]
            lane = lanes.index(n.stream)
            (x0, y0), (x1, y1) = ax.transData.transform(
                [(n.start_us, lane - 0.4), (n.start_us + n.duration_us, lane + 0.4)])
            assert x0 <= box.x0 and box.x1 <= x1 and y0 <= box.y0 and box.y1 <= y1
        # every nano-op is named: on its bar, or in the note under the chart
        named = {t.get_text().replace("\n", " ").split(" ")[0] for t in labels}
        note = " ".join(t.get_text() for t in fig.texts)
        assert all(n.id in named or n.id in note for n in s.nano_ops)
    finally:
        plt.close(fig)

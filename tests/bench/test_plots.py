"""Plot axes a reader can read: which minor ticks of a log axis get labels."""

from flashmesh.bench import plots


def test_minor_ticks_of_two_decades_are_labelled_at_2x_and_5x_only():
    labels = {y: plots._minor_label(y, every=False) for y in (0.2, 0.5, 0.7, 0.9, 2.0, 3.0, 50.0)}
    assert labels == {0.2: "0.2", 0.5: "0.5", 0.7: "", 0.9: "", 2.0: "2", 3.0: "", 50.0: "50"}
    assert plots._minor_label(0.7, every=True) == "0.7"

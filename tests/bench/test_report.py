"""Report metadata: the commit a run records."""

import subprocess

from flashmesh.bench import report


def test_commit_names_a_modified_tree(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHMESH_COMMIT", raising=False)
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c",  # noqa: E731
                                     "user.email=t@t", *a], check=True, capture_output=True, text=True)
    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("commit", "-qm", "one")
    head = git("rev-parse", "--short=12", "HEAD").stdout.strip()
    assert report.git_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("b")  # a copied tree whose .git is stale
    assert report.git_commit(tmp_path) == head + "+modified"
    monkeypatch.setenv("FLASHMESH_COMMIT", "abc1234")
    assert report.git_commit(tmp_path) == "abc1234"

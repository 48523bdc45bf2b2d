"""The demo `make demo` runs (split-mnist through nws-train), here with a tiny model and one task."""

from nwsconvert import RunDir, demo


def test_demo_runs_and_continues(tmp_path, capsys):
    args = ["model=timm:test_resnet", "pool_size=32", "epochs=1", "pool_epochs=1", "tasks=2", "progress=false", f"out={tmp_path / 'd'}"]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "task 1 (task1:2-3): acc" in out and "rebuilt from pack" in out
    assert "dense finetune total" in out and "NWS total (2 tasks)" in out
    assert [t["id"] for t in RunDir(tmp_path / "d").read()["tasks"]] == [0, 1]
    assert demo.main(args) == 0  # a second run continues the existing one
    assert "continuing it" in capsys.readouterr().out

"""The demo `make demo` runs: exits 0 and prints the report, the identity checks and the size table."""

from nwsconvert import demo


def test_demo_runs(capsys):
    assert demo.main(["--init", "random", "--pool-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "layer4.1.conv2" in out
    assert "materialised dense model identical: True" in out
    assert "fresh model bitwise identical: True" in out
    assert "dense finetune (1 model/task)" in out

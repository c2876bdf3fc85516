"""`nanosched profile` end to end on a simulated GPU, and `profile show`."""

import json

from typer.testing import CliRunner

from nanosched.cli import app

runner = CliRunner()


def test_profile_fake_gpu_then_show_with_plot(tmp_path):
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["profile", "--fake-gpu", "--model", "llama3-8b", "--quick",
                            "--dense-batch", "256", "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "dense batch 256" in r.output and "took" in r.output
    data = json.loads(out.read_text())
    assert data["format"] == "nanosched.profile/1" and data["rp"]["memory"]
    png = tmp_path / "p.png"
    r = runner.invoke(app, ["profile", "show", str(out), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "best time (us) on all SMs" in r.output and "R->P tables" in r.output
    assert png.stat().st_size > 10_000


def test_profile_errors_name_the_input(tmp_path):
    r = runner.invoke(app, ["profile", "--fake-gpu"])
    assert r.exit_code == 2 and "needs --model" in r.output
    r = runner.invoke(app, ["profile", "--fake-gpu", "--model", "llama3-8b", "--resume",
                            "--out", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "no partial profile" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "nanosched.profile/1", "identity"')
    r = runner.invoke(app, ["profile", "show", str(bad)])
    assert r.exit_code == 2 and "not valid JSON" in r.output

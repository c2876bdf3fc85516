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


def test_profile_rederive_rewrites_the_rp_tables(tmp_path):
    """A profile whose R->P points were derived by another rule gets them again from its pairs
    and kernel rows; a current one is left as it is; a missing file is named."""
    from nanosched.profiler.catalog import shipped_profiles

    shipped = json.loads(shipped_profiles()["llama3-8b-tp1-h100"].read_text())
    old = {**shipped, "rp": {"memory": shipped["rp"]["memory"][:1]}, "rp_shapes": {}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    r = runner.invoke(app, ["profile", "rederive", str(path), "--out", str(tmp_path / "new.json")])
    assert r.exit_code == 0 and "(changed)" in r.output, r.output
    new = json.loads((tmp_path / "new.json").read_text())
    assert (new["rp"], new["rp_shapes"]) == (shipped["rp"], shipped["rp_shapes"])
    r = runner.invoke(app, ["profile", "rederive", str(tmp_path / "new.json")])
    assert r.exit_code == 0 and "(unchanged)" in r.output, r.output
    r = runner.invoke(app, ["profile", "rederive", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "missing.json" in r.output


def test_profile_time_limit_stops_with_exit_75_and_resume_finishes(tmp_path):
    """A limit too short for any row: the partial file is saved, the message says how to go on,
    exit 75; --resume without a limit writes the profile; a limit of 0 is refused."""
    out = tmp_path / "p.json"
    argv = ["profile", "--fake-gpu", "--model", "llama3-8b", "--quick", "--dense-batch", "128",
            "--out", str(out), "--no-progress"]
    r = runner.invoke(app, [*argv, "--time-limit", "1"])
    assert r.exit_code == 75, r.output
    assert "time limit: stopped before kernel row" in r.output and "--resume" in r.output
    assert (tmp_path / "p.partial.json").exists() and not out.exists()
    r = runner.invoke(app, [*argv, "--resume"])
    assert r.exit_code == 0, r.output
    assert out.exists() and not (tmp_path / "p.partial.json").exists()
    r = runner.invoke(app, [*argv, "--time-limit", "0"])
    assert r.exit_code == 2 and "--time-limit must be a positive number" in r.output

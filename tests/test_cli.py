"""The command line: output of a good call, one clean line and exit 2 on bad input."""

from specdec_jax.cli import main


def test_theory_prints_closed_form(capsys):
    assert main(["theory", "--alpha", "0.8", "--gamma", "4"]) == 0
    assert "3.3616" in capsys.readouterr().out


def test_bad_value_is_one_line_and_exit_2(capsys):
    assert main(["theory", "--alpha", "1.5", "--gamma", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "alpha must be in [0, 1], got 1.5" in err[0]

"""tmd.protocol.usage: tmd and tmctl end a usage error the same way, one ``error:`` line and exit 2, no panel."""
import pytest

import tmctl.cli
import tmd.cli


@pytest.mark.parametrize("main, argv, expected", [
    (tmctl.cli.main, ["status", "--bogus"], "error: No such option: --bogus"),
    (tmctl.cli.main, ["migrate", "--from"], "error: Option '--from' requires an argument."),
    (tmctl.cli.main, ["no-such-command"], "error: No such command 'no-such-command'."),
    (tmd.cli.main, ["local", "--bogus-flag"], "error: No such option: --bogus-flag"),
])
def test_a_usage_error_is_one_line_and_exit_2(main, argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2
    assert err.splitlines() == [expected] and out == ""


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        tmctl.cli.main(["--help"])
    assert e.value.code == 0 and "migrate" in capsys.readouterr().out

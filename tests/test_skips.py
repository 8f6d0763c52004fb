"""``skip_or_fail``: a skip on a developer's machine, a failure in CI, whatever spelling of CI the service uses."""

import pytest

from tests.skips import in_ci, skip_or_fail


@pytest.mark.parametrize("value", ["true", "True", "TRUE", "1", "yes", " true\n", "on"])
def test_ci_as_services_spell_it_turns_a_skip_into_a_failure(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert in_ci()
    with pytest.raises(pytest.fail.Exception, match="CI must run this test .* but: no widget here"):
        skip_or_fail("no widget here")


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", "False"])
def test_outside_ci_the_test_is_skipped_with_its_reason(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception, match="no widget here"):
        skip_or_fail("no widget here")

"""nanogpt/optional.py: a missing or broken optional package is one line naming the pip command."""
from __future__ import annotations

import json

import pytest

from nanogpt import optional
from nanogpt.errors import UserError


def test_an_optional_package_missing_or_broken_is_a_user_error_naming_pip(tmp_path, monkeypatch):
    (tmp_path / "broken_extra").mkdir()  # installed, but one of its own imports is missing
    (tmp_path / "broken_extra" / "__init__.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as missing:
        optional.optional_import("no_such_package_xyz", "--feature=True")
    assert str(missing.value) == ("--feature=True needs no_such_package_xyz, which is not installed: "
                                  "pip install no_such_package_xyz")
    with pytest.raises(UserError) as broken:
        optional.optional_import("broken_extra", "--feature=True")
    assert str(broken.value) == ("--feature=True needs broken_extra, which fails to import (No module named "
                                 "'no_such_dependency_xyz'): pip install broken_extra")
    assert optional.optional_import("json", "--feature=True") is json

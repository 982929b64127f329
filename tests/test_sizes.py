import pytest

from hf_paged.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (4096, 4096), ("4096", 4096), ("8MiB", 8 * 2**20), ("8 mib", 8 * 2**20), ("1.5GiB", 3 * 2**29),
     ("2GB", 2 * 10**9), ("512KiB", 512 * 1024), ("64B", 64), (1e6, 10**6), ("4.1MB", 4_100_000),
     ("8.2GB", 8_200_000_000), ("16.1KB", 16_100), ("0.5TiB", 2**39), (2**60 + 1, 2**60 + 1)],
)
def test_parse_size(value, expected):
    assert parse_size(value, "page_size") == expected


@pytest.mark.parametrize(
    "value", ["", "lots", "8 MiBs", "-1MiB", "1.5", "nan", "inf MiB", "1e999999999", "1e-999999999MB", "1e31"]
)
def test_parse_size_rejects_bad_strings(value):
    with pytest.raises(ValueError, match="page_size"):
        parse_size(value, "page_size")


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), -(10**400)])
def test_parse_size_rejects_bad_numbers(value):
    with pytest.raises(ValueError, match="device_budget"):
        parse_size(value, "device_budget")


@pytest.mark.parametrize("value", [True, None, [1]])
def test_parse_size_rejects_other_types(value):
    with pytest.raises(TypeError, match="device_budget"):
        parse_size(value, "device_budget")


def test_format_size():
    assert format_size(8 * 2**20) == "8.0 MiB"
    assert format_size(100) == "100 B"

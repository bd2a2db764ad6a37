"""EEA membership as data: the 27 EU member states plus Iceland, Liechtenstein and Norway (ISO 3166-1 alpha-2).

Policy `jurisdiction: EEA` expands to this set at compile time. Greece is "GR" in ISO 3166 (the EU's own
"EL" abbreviation is accepted as an alias by the compiler, never stored here).
"""
from __future__ import annotations

EU_COUNTRIES: frozenset[str] = frozenset({
    "AT", "BE", "BG", "HR", "CY", "CZ", "DK", "EE", "FI", "FR", "DE", "GR", "HU", "IE",
    "IT", "LV", "LT", "LU", "MT", "NL", "PL", "PT", "RO", "SK", "SI", "ES", "SE",
})
EFTA_EEA_COUNTRIES: frozenset[str] = frozenset({"IS", "LI", "NO"})
EEA_COUNTRIES: frozenset[str] = EU_COUNTRIES | EFTA_EEA_COUNTRIES

# Every officially assigned ISO 3166-1 alpha-2 code (249). Backend locations and policy country lists must use
# one of these: "UK" (ISO says GB), "EL" (GR) or a typo such as "DU" pass a two-capital-letters check but would
# silently match no backend.
ISO_3166_ALPHA2: frozenset[str] = frozenset({
    "AD", "AE", "AF", "AG", "AI", "AL", "AM", "AO", "AQ", "AR", "AS", "AT", "AU", "AW", "AX", "AZ", "BA", "BB",
    "BD", "BE", "BF", "BG", "BH", "BI", "BJ", "BL", "BM", "BN", "BO", "BQ", "BR", "BS", "BT", "BV", "BW", "BY",
    "BZ", "CA", "CC", "CD", "CF", "CG", "CH", "CI", "CK", "CL", "CM", "CN", "CO", "CR", "CU", "CV", "CW", "CX",
    "CY", "CZ", "DE", "DJ", "DK", "DM", "DO", "DZ", "EC", "EE", "EG", "EH", "ER", "ES", "ET", "FI", "FJ", "FK",
    "FM", "FO", "FR", "GA", "GB", "GD", "GE", "GF", "GG", "GH", "GI", "GL", "GM", "GN", "GP", "GQ", "GR", "GS",
    "GT", "GU", "GW", "GY", "HK", "HM", "HN", "HR", "HT", "HU", "ID", "IE", "IL", "IM", "IN", "IO", "IQ", "IR",
    "IS", "IT", "JE", "JM", "JO", "JP", "KE", "KG", "KH", "KI", "KM", "KN", "KP", "KR", "KW", "KY", "KZ", "LA",
    "LB", "LC", "LI", "LK", "LR", "LS", "LT", "LU", "LV", "LY", "MA", "MC", "MD", "ME", "MF", "MG", "MH", "MK",
    "ML", "MM", "MN", "MO", "MP", "MQ", "MR", "MS", "MT", "MU", "MV", "MW", "MX", "MY", "MZ", "NA", "NC", "NE",
    "NF", "NG", "NI", "NL", "NO", "NP", "NR", "NU", "NZ", "OM", "PA", "PE", "PF", "PG", "PH", "PK", "PL", "PM",
    "PN", "PR", "PS", "PT", "PW", "PY", "QA", "RE", "RO", "RS", "RU", "RW", "SA", "SB", "SC", "SD", "SE", "SG",
    "SH", "SI", "SJ", "SK", "SL", "SM", "SN", "SO", "SR", "SS", "ST", "SV", "SX", "SY", "SZ", "TC", "TD", "TF",
    "TG", "TH", "TJ", "TK", "TL", "TM", "TN", "TO", "TR", "TT", "TV", "TW", "TZ", "UA", "UG", "UM", "US", "UY",
    "UZ", "VA", "VC", "VE", "VG", "VI", "VN", "VU", "WF", "WS", "YE", "YT", "ZA", "ZM", "ZW",
})
COMMON_MISTAKES: dict[str, str] = {"UK": "GB", "EL": "GR"}


def country_error(code: str) -> str | None:
    """None for an assigned ISO 3166-1 alpha-2 code, else why not (with the right code for common mistakes)."""
    if code in ISO_3166_ALPHA2:
        return None
    hint = f" (use {COMMON_MISTAKES[code]})" if code in COMMON_MISTAKES else ""
    return f"{code!r} is not an assigned ISO 3166-1 alpha-2 country code{hint}"

# Named jurisdictions a policy may use instead of a country list.
JURISDICTIONS: dict[str, frozenset[str]] = {"EEA": EEA_COUNTRIES, "EU": EU_COUNTRIES}

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

# Named jurisdictions a policy may use instead of a country list.
JURISDICTIONS: dict[str, frozenset[str]] = {"EEA": EEA_COUNTRIES, "EU": EU_COUNTRIES}

from gateway.policy.eea import EEA_COUNTRIES, EU_COUNTRIES


def test_eea_is_eu27_plus_iceland_liechtenstein_norway():
    assert len(EU_COUNTRIES) == 27
    assert EEA_COUNTRIES == EU_COUNTRIES | {"IS", "LI", "NO"}
    assert len(EEA_COUNTRIES) == 30
    for c in ("DE", "FR", "GR", "HR", "IE", "SE", "NO", "IS", "LI"):
        assert c in EEA_COUNTRIES
    for c in ("GB", "CH", "US", "EL", "UK", "TR"):  # Switzerland and the UK are not in the EEA
        assert c not in EEA_COUNTRIES
    assert all(len(c) == 2 and c.isupper() for c in EEA_COUNTRIES)

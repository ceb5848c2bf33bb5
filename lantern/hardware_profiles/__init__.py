"""The hardware profiles lantern ships (installed as lantern.hardware_profiles): see docs/profiles.md."""

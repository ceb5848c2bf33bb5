"""Cross-hardware profile suite: hardware profiles, measurements, results files, reports and tree tuning."""

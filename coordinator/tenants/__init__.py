"""Tenancy: API keys and tenants, admission (quotas, concurrent streams, the weighted queue) and the usage ledger."""

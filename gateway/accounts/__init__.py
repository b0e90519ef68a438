"""Hosted-mode accounts: organizations, API keys, credits, the usage ledger, concurrency limits.

A library with no dependency on the Starlette app. One concern per module:
db (URLs, engine, migrations at open) · schema · migrations · money (nano-dollar integers) ·
orgs / keys (admin operations) · auth (Authorization -> Principal) · catalog (served models, prices) ·
metering (generation ids, ledger, debits, GET /v1/usage pages) · limits (in-memory concurrency) ·
limits_redis (concurrency shared by replicas).
"""

"""divtrace audit: which recorded ops are not batch-invariant or not deterministic (see core.py)."""
from divtrace.audit.core import AuditResult, Group, OpAudit, audit

__all__ = ["audit", "AuditResult", "Group", "OpAudit"]

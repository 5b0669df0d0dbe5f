"""The ``ferry`` PySpark data source: ``df.write.format("ferry")`` into a Ferry spool directory.

    import spark_writer
    spark_writer.register(spark)
    df.write.format("ferry").mode("append").save("/var/lib/ferry/spool")

Needs Spark 4.1 or later (streaming writes use ``DataSourceStreamArrowWriter``) and pyarrow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_writer.datasource import (
    FerryBatchWriter,
    FerryCommitMessage,
    FerryDataSource,
    FerryPublishError,
    FerrySchemaError,
    FerryStreamWriter,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "FerryBatchWriter",
    "FerryCommitMessage",
    "FerryDataSource",
    "FerryPublishError",
    "FerrySchemaError",
    "FerryStreamWriter",
    "register",
]


def register(spark: SparkSession) -> None:
    """Make ``format("ferry")`` available in ``spark`` (once per session)."""
    spark.dataSource.register(FerryDataSource)

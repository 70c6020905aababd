"""initial catalog schema

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('blobs',
    sa.Column('digest', sa.String(length=71), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('stored_size', sa.BigInteger(), nullable=False),
    sa.Column('codec', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('digest', name=op.f('pk_blobs'))
    )
    op.create_table('events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=255), nullable=False),
    sa.Column('host', sa.String(length=255), nullable=False),
    sa.Column('action', sa.String(length=64), nullable=False),
    sa.Column('repository', sa.String(length=255), nullable=True),
    sa.Column('tag', sa.String(length=128), nullable=True),
    sa.Column('digest', sa.String(length=71), nullable=True),
    sa.Column('outcome', sa.String(length=32), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_action'), ['action'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_digest'), ['digest'], unique=False)

    op.create_table('models',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('identity', sa.String(length=71), nullable=False),
    sa.Column('architecture', sa.String(length=71), nullable=False),
    sa.Column('tokenizer', sa.String(length=71), nullable=False),
    sa.Column('weights', sa.String(length=71), nullable=True),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('config', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_models')),
    sa.UniqueConstraint('identity', name=op.f('uq_models_identity'))
    )
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_models_architecture'), ['architecture'], unique=False)

    op.create_table('artifacts',
    sa.Column('digest', sa.String(length=71), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('manifest', sa.Text(), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('token_count', sa.BigInteger(), nullable=False),
    sa.Column('chunk_tokens', sa.Integer(), nullable=False),
    sa.Column('file_digest', sa.String(length=71), nullable=False),
    sa.Column('file_size', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['models.id'], name=op.f('fk_artifacts_model_id_models')),
    sa.PrimaryKeyConstraint('digest', name=op.f('pk_artifacts'))
    )
    with op.batch_alter_table('artifacts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_artifacts_model_id'), ['model_id'], unique=False)

    op.create_table('artifact_blobs',
    sa.Column('artifact_digest', sa.String(length=71), nullable=False),
    sa.Column('blob_digest', sa.String(length=71), nullable=False),
    sa.ForeignKeyConstraint(['artifact_digest'], ['artifacts.digest'], name=op.f('fk_artifact_blobs_artifact_digest_artifacts'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['blob_digest'], ['blobs.digest'], name=op.f('fk_artifact_blobs_blob_digest_blobs')),
    sa.PrimaryKeyConstraint('artifact_digest', 'blob_digest', name=op.f('pk_artifact_blobs'))
    )
    with op.batch_alter_table('artifact_blobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_artifact_blobs_blob_digest'), ['blob_digest'], unique=False)

    op.create_table('artifact_chunks',
    sa.Column('artifact_digest', sa.String(length=71), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('start', sa.BigInteger(), nullable=False),
    sa.Column('end', sa.BigInteger(), nullable=False),
    sa.Column('blob_digest', sa.String(length=71), nullable=False),
    sa.Column('prefix_key', sa.String(length=71), nullable=False),
    sa.ForeignKeyConstraint(['artifact_digest'], ['artifacts.digest'], name=op.f('fk_artifact_chunks_artifact_digest_artifacts'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['blob_digest'], ['blobs.digest'], name=op.f('fk_artifact_chunks_blob_digest_blobs')),
    sa.PrimaryKeyConstraint('artifact_digest', 'idx', name=op.f('pk_artifact_chunks'))
    )
    with op.batch_alter_table('artifact_chunks', schema=None) as batch_op:
        batch_op.create_index('ix_artifact_chunks_blob_digest', ['blob_digest'], unique=False)
        batch_op.create_index(batch_op.f('ix_artifact_chunks_prefix_key'), ['prefix_key'], unique=False)

    op.create_table('attestations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('artifact_digest', sa.String(length=71), nullable=False),
    sa.Column('predicate_type', sa.String(length=255), nullable=False),
    sa.Column('statement', sa.Text(), nullable=False),
    sa.Column('statement_digest', sa.String(length=71), nullable=False),
    sa.Column('envelope', sa.Text(), nullable=True),
    sa.Column('keyid', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['artifact_digest'], ['artifacts.digest'], name=op.f('fk_attestations_artifact_digest_artifacts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attestations'))
    )
    with op.batch_alter_table('attestations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_attestations_artifact_digest'), ['artifact_digest'], unique=False)

    op.create_table('labels',
    sa.Column('artifact_digest', sa.String(length=71), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['artifact_digest'], ['artifacts.digest'], name=op.f('fk_labels_artifact_digest_artifacts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('artifact_digest', 'key', name=op.f('pk_labels'))
    )
    op.create_table('repository_artifacts',
    sa.Column('repository', sa.String(length=255), nullable=False),
    sa.Column('artifact_digest', sa.String(length=71), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['artifact_digest'], ['artifacts.digest'], name=op.f('fk_repository_artifacts_artifact_digest_artifacts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('repository', 'artifact_digest', name=op.f('pk_repository_artifacts'))
    )
    with op.batch_alter_table('repository_artifacts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_repository_artifacts_artifact_digest'), ['artifact_digest'], unique=False)

    op.create_table('tags',
    sa.Column('repository', sa.String(length=255), nullable=False),
    sa.Column('tag', sa.String(length=128), nullable=False),
    sa.Column('artifact_digest', sa.String(length=71), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['artifact_digest'], ['artifacts.digest'], name=op.f('fk_tags_artifact_digest_artifacts')),
    sa.PrimaryKeyConstraint('repository', 'tag', name=op.f('pk_tags'))
    )
    with op.batch_alter_table('tags', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tags_artifact_digest'), ['artifact_digest'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('tags', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tags_artifact_digest'))

    op.drop_table('tags')
    with op.batch_alter_table('repository_artifacts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_repository_artifacts_artifact_digest'))

    op.drop_table('repository_artifacts')
    op.drop_table('labels')
    with op.batch_alter_table('attestations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attestations_artifact_digest'))

    op.drop_table('attestations')
    with op.batch_alter_table('artifact_chunks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_artifact_chunks_prefix_key'))
        batch_op.drop_index('ix_artifact_chunks_blob_digest')

    op.drop_table('artifact_chunks')
    with op.batch_alter_table('artifact_blobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_artifact_blobs_blob_digest'))

    op.drop_table('artifact_blobs')
    with op.batch_alter_table('artifacts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_artifacts_model_id'))

    op.drop_table('artifacts')
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_models_architecture'))

    op.drop_table('models')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_digest'))
        batch_op.drop_index(batch_op.f('ix_events_at'))
        batch_op.drop_index(batch_op.f('ix_events_action'))

    op.drop_table('events')
    op.drop_table('blobs')

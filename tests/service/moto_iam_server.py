"""moto's S3 server, authorizing each S3 request by the IAM action AWS documents for it.

AWS authorizes an S3 request by its IAM action, not by its API operation: CreateMultipartUpload, UploadPart and
CompleteMultipartUpload need `s3:PutObject`, HeadObject `s3:GetObject`, ListObjectsV2 `s3:ListBucket`
(docs.aws.amazon.com/AmazonS3/latest/userguide/mpuoverview.html#mpuAndPermissions). moto's S3 handler knows this
(`moto.s3.responses.ACTION_MAP`, which it writes into the request's `Action` before it authorizes), and moto up
to 5.2.5 authorized by that. moto 5.2.6 takes the action from botocore's operation instead
(`BaseResponse._get_action` no longer reads `Action`), so it asks for `s3:CreateMultipartUpload`, an action no
IAM policy grants, and denies every multipart upload to a policy that is right on AWS and MinIO.

This restores the documented actions for the authorization check only, on every moto version, so the policy test
checks what AWS and MinIO enforce. Run as `python moto_iam_server.py -H HOST -p PORT` (moto.server's arguments).
"""

from __future__ import annotations

import sys
from typing import Any

from moto.s3.responses import S3Response
from moto.server import main

_authorize = S3Response._authenticate_and_authorize_s3_action
_operation = S3Response._get_action


def _authorize_by_iam_action(self: Any, *args: Any, **kwargs: Any) -> None:
    self._tokenmill_iam_action = self.data.get("Action")  # set from ACTION_MAP by S3Response._set_action
    try:
        _authorize(self, *args, **kwargs)
    finally:
        self._tokenmill_iam_action = None


def _action(self: Any) -> str:
    return getattr(self, "_tokenmill_iam_action", None) or _operation(self)


S3Response._authenticate_and_authorize_s3_action = _authorize_by_iam_action
S3Response._get_action = _action

if __name__ == "__main__":
    main(sys.argv[1:])

"""What media the towers take, before anything is decoded: torch-free, so settings and the
dispatcher read it without loading a model stack."""

# Decoded pixels of one image, checked from the header (or the shape) before decoding: a small
# file may declare a huge image, and decoding and preprocessing cost memory and CPU in proportion
# to its pixels. 4096 x 4096 is above a 12 MP photo and above what the Qwen2.5-VL and Qwen3-VL
# processors resize to (12.8 and 16.8 M pixels).
MAX_PIXELS = 16 << 20
MAX_SIDE = 16384  # an image's side, whatever its pixels
# PIL's names, read from the header (MPO: a JPEG with more than one picture, as phones write them;
# GIF and MPO give their first frame, as vLLM does)
IMAGE_FORMATS = {"PNG", "JPEG", "MPO", "WEBP", "BMP", "GIF"}
# FFmpeg's demuxer name for the ISO base media family (MP4, MOV, M4V, 3GP): containers that state
# their frame count in the header, so a video is sized without decoding it.
VIDEO_CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "MP4/MOV"}
MAX_VIDEO_SIDE = 8192
